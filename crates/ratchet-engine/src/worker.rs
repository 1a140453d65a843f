//! The worker pool: tasks that claim step jobs, run them through the Engine while renewing
//! their lease, and hand the results to the Coordinator.
//!
//! Jobs live in the store's outbox, not in memory: a wake-up only says "look now", and a
//! periodic poll finds whatever a wake-up missed. A worker that commits a step takes the
//! run's next job in the same transaction and goes on with it, up to `max_streak` steps.

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::trace::FutureExt as _;
use ratchet_core::step::{CallEnding, cut_off_step, finish_step, untold_endings};
use ratchet_core::{EventDraft, EventKind, Message, StopReason};
use ratchet_store::{ClaimedStep, Commit, Lease};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use crate::engine::{Executed, context_after, with_intents};
use crate::{Coordinator, Engine, PoolConfig, StepFailure};

/// Names this process as a lease owner: `host:pid:instance`. Recovery on this host can tell
/// from it whether the owner process is still alive.
pub fn process_owner() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "localhost".into());
    format!("{host}:{}:{}", std::process::id(), Uuid::now_v7().simple())
}

/// True when `owner` names a process on this host that no longer runs (or is a zombie: it
/// has exited and only waits to be reaped).
pub fn owner_is_dead_local_process(owner: &str) -> bool {
    let mut parts = owner.splitn(3, ':');
    let (Some(host), Some(pid), Some(_)) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let this_host =
        std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned());
    let Ok(pid) = pid.parse::<u32>() else {
        return false;
    };
    let gone = || match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => true,
    };
    this_host.is_ok_and(|h| h == host) && pid != std::process::id() && gone()
}

/// How often a step that runs on reads whether a cancel of its run was accepted elsewhere.
const CANCEL_WATCH: Duration = Duration::from_secs(1);
/// How long a step cut off by a cancel waits for the cancel's transaction to commit before it
/// takes the cancel for one the store refused and gives the step back.
const CANCEL_RECORDED: Duration = Duration::from_secs(5);

/// How often every pool sweeps, however busy its workers are.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// Expired idempotency keys are swept on every this many sweeps.
const KEYS_EVERY: u32 = 60;

/// Sweeps on a cadence of its own until `shutdown`: ends runs that wait past their deadline
/// and, unless the pool serves one run, starts due continuation turns, re-offers or expires
/// released inbox reports and (once a minute) forgets expired idempotency keys. An idle worker
/// sweeps deadlines and inboxes too, at once when woken; this loop is what holds when every
/// worker is busy. Every process races for the same rows freely: each sweep is one
/// transaction per run or session (or one statement), and a row another process swept first
/// is not there any more.
async fn sweep(coordinator: Arc<Coordinator>, inboxes: bool, shutdown: CancellationToken) {
    let mut sweeps: u32 = 0;
    loop {
        tokio::select! {
            () = tokio::time::sleep(SWEEP_EVERY) => {}
            () = shutdown.cancelled() => return,
        }
        sweeps = sweeps.wrapping_add(1);
        if let Err(error) = coordinator.time_out_overdue().await {
            tracing::warn!(%error, "ending runs past their deadline failed");
        }
        if !inboxes {
            continue;
        }
        if let Err(error) = coordinator.serve_inboxes().await {
            tracing::warn!(%error, "starting due continuation turns failed");
        }
        if sweeps.is_multiple_of(KEYS_EVERY)
            && let Err(error) = coordinator.sweep_requests().await
        {
            tracing::warn!(%error, "sweeping expired idempotency keys failed");
        }
    }
}

/// Why a worker cut its own step off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CutOff {
    /// The run's `max_duration_ms` passed: the run ends `timed_out`.
    Deadline,
    /// The process is shutting down: the step is given back.
    Shutdown,
}

pub struct WorkerPool {
    shutdown: CancellationToken,
    tracker: TaskTracker,
    owner: String,
}

impl WorkerPool {
    pub fn start(
        coordinator: Arc<Coordinator>,
        engine: Arc<Engine>,
        config: PoolConfig,
    ) -> WorkerPool {
        let shutdown = CancellationToken::new();
        let tracker = TaskTracker::new();
        let owner = process_owner();
        for index in 0..config.workers.max(1) {
            let worker = Worker {
                // One worker of the pool ends runs waiting past their deadline and starts due
                // continuations: the others would only repeat its queries. A pool scoped to one
                // run still ends waiting runs past their deadline (that run's tree may wait on a
                // human), but starts no other session's turns.
                sweeps_deadlines: index == 0,
                serves_inboxes: index == 0 && config.only_run.is_none(),
                coordinator: Arc::clone(&coordinator),
                engine: Arc::clone(&engine),
                config: config.clone(),
                owner: owner.clone(),
                shutdown: shutdown.clone(),
            };
            tracker.spawn(worker.run());
        }
        tracker.spawn(sweep(
            Arc::clone(&coordinator),
            config.only_run.is_none(),
            shutdown.clone(),
        ));
        // A pool scoped to one run (`ratchet run`) fires no schedule: it serves that run alone.
        if config.only_run.is_none() {
            tracker.spawn(crate::scheduler::run(
                Arc::clone(&coordinator),
                shutdown.clone(),
            ));
        }
        tracker.close();
        WorkerPool {
            shutdown,
            tracker,
            owner,
        }
    }

    /// The lease owner this pool's workers claim as (`host:pid:instance`).
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// Stops claiming and waits for in-flight steps to commit.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        self.tracker.wait().await;
    }
}

struct Worker {
    sweeps_deadlines: bool,
    serves_inboxes: bool,
    coordinator: Arc<Coordinator>,
    engine: Arc<Engine>,
    config: PoolConfig,
    owner: String,
    shutdown: CancellationToken,
}

impl Worker {
    fn lease(&self) -> Lease {
        Lease {
            owner: self.owner.clone(),
            expires_at: self.coordinator.now() + self.config.lease.as_millis() as i64,
        }
    }

    async fn run(self) {
        let only = self.config.only_run.as_ref();
        while !self.shutdown.is_cancelled() {
            match self.coordinator.claim_next(self.lease(), only).await {
                Ok(Some(claimed)) => {
                    // Another job may be waiting behind this one: pass the wake-up on.
                    self.coordinator.wake_one();
                    self.run_streak(claimed).await;
                }
                Ok(None) => {
                    if self.sweeps_deadlines {
                        match self.coordinator.time_out_overdue().await {
                            Ok(0) => {}
                            Ok(_) => continue,
                            Err(error) => {
                                tracing::warn!(%error, "ending runs past their deadline failed");
                            }
                        }
                    }
                    if self.serves_inboxes {
                        match self.coordinator.serve_inboxes().await {
                            Ok(0) => {}
                            Ok(_) => continue,
                            Err(error) => {
                                tracing::warn!(%error, "starting due continuation turns failed");
                            }
                        }
                    }
                    tokio::select! {
                        () = self.coordinator.woken() => {}
                        () = tokio::time::sleep(self.config.poll) => {}
                        () = self.shutdown.cancelled() => {}
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "claiming a step failed; backing off");
                    tokio::time::sleep(self.config.poll).await;
                }
            }
        }
    }

    /// Runs a claimed step and then, while this worker is handed them, the run's next ones.
    /// The run's cancellation token is registered for the whole streak, so a cancel request
    /// arriving between two steps still reaches the next one.
    async fn run_streak(&self, first: ClaimedStep) {
        let run_id = first.job.run_id.clone();
        let cancel = self.coordinator.streak_started(&run_id);
        let mut current = Some(first);
        let mut streak = 0;
        while let Some(claimed) = current.take() {
            streak += 1;
            let may_continue = streak < self.config.max_streak && !self.shutdown.is_cancelled();
            current = self.run_step(claimed, &cancel, may_continue).await;
        }
        self.coordinator.streak_ended(&run_id);
    }

    /// Runs one step to its commit, within the step's span; returns the run's next step when
    /// this worker holds it.
    async fn run_step(
        &self,
        claimed: ClaimedStep,
        cancel: &CancellationToken,
        may_continue: bool,
    ) -> Option<ClaimedStep> {
        let span = ratchet_telemetry::start_step(&claimed.state, &claimed.job);
        let next = self
            .run_step_in_span(claimed, cancel, may_continue)
            .with_context(span.clone())
            .await;
        ratchet_telemetry::end_step(&span);
        next
    }

    async fn run_step_in_span(
        &self,
        claimed: ClaimedStep,
        cancel: &CancellationToken,
        may_continue: bool,
    ) -> Option<ClaimedStep> {
        let (outcome, cut_off) = self.execute_with_heartbeat(&claimed, cancel).await;
        let finish = |reason| {
            finish_step(
                claimed.state.clone(),
                &claimed.job,
                reason,
                self.coordinator.now(),
                self.coordinator.now(),
            )
        };
        let outcome = match (outcome, cut_off) {
            (Err(StepFailure::Cancelled), Some(CutOff::Deadline)) => {
                return self.end_cut_off(&claimed, StopReason::TimedOut, None).await;
            }
            (Err(StepFailure::CutOff { endings, events }), Some(CutOff::Deadline)) => {
                let batch = Some((endings, events));
                return self
                    .end_cut_off(&claimed, StopReason::TimedOut, batch)
                    .await;
            }
            // Shutting down: the step is given back, as a crash would leave it, and another
            // worker (here after a restart, or another process) takes it over: `never` calls'
            // outcomes are in their intents, `keyed` and `safe` calls run again by policy.
            (Err(StepFailure::Cancelled | StepFailure::CutOff { .. }), Some(CutOff::Shutdown)) => {
                self.back_off(&claimed, "the process shut down during the step")
                    .await;
                return None;
            }
            (outcome, _) => outcome,
        };
        let (result, context) = match outcome {
            Ok(Executed { result, context }) => (result, context),
            Err(StepFailure::Transient {
                message,
                attempt,
                retry_after,
            }) => {
                return self
                    .retry_or_fail(&claimed, message, attempt, retry_after)
                    .await;
            }
            Err(StepFailure::Fatal(message)) => {
                tracing::warn!(run = %claimed.job.run_id, %message, "model call failed for good");
                let mut result = finish(StopReason::LlmError);
                result
                    .events
                    .insert(0, model_error_event(&claimed, &message, None, true));
                (result, None)
            }
            // Only a cancel request cancels a run's token or refuses its intents; the store
            // already marked the run `cancelling`, so this step ends it.
            Err(StepFailure::Cancelled) => {
                return self
                    .end_cut_off(&claimed, StopReason::Cancelled, None)
                    .await;
            }
            Err(StepFailure::CutOff { endings, events }) => {
                let batch = Some((endings, events));
                return self
                    .end_cut_off(&claimed, StopReason::Cancelled, batch)
                    .await;
            }
            Err(StepFailure::LeaseLost) => {
                tracing::info!(run = %claimed.job.run_id, step = claimed.job.step_index, "lease lost; another worker has the step");
                return None;
            }
            Err(StepFailure::Infrastructure(error)) => {
                self.back_off(&claimed, &error.to_string()).await;
                return None;
            }
        };
        // Decided at commit time: a shutdown that arrived while the step ran must not hand this
        // worker the run's next step.
        let continue_with = (may_continue && !self.shutdown.is_cancelled()).then(|| self.lease());
        let next = self.commit(&claimed, result, continue_with).await;
        next.map(|(mut next, added)| {
            next.context = context_after(context, &added);
            next
        })
    }

    /// Commits the step; returns the run's next step when this worker holds it, with the
    /// messages the commit added.
    async fn commit(
        &self,
        claimed: &ClaimedStep,
        mut result: ratchet_core::StepResult,
        continue_with: Option<Lease>,
    ) -> Option<(ClaimedStep, Vec<Message>)> {
        sign(&mut result, &self.owner);
        let instruction = result.record.instruction.clone();
        let seconds = (result.record.finished_at - result.record.started_at) as f64 / 1000.0;
        let (before, after) = (&claimed.state.counters, &result.state.counters);
        let spent = [
            (
                "input",
                after.input_tokens.saturating_sub(before.input_tokens),
            ),
            (
                "output",
                after.output_tokens.saturating_sub(before.output_tokens),
            ),
            (
                "reasoning",
                after
                    .reasoning_tokens
                    .saturating_sub(before.reasoning_tokens),
            ),
            (
                "cache_write",
                after
                    .cache_write_tokens
                    .saturating_sub(before.cache_write_tokens),
            ),
            (
                "cache_read",
                after
                    .cache_read_tokens
                    .saturating_sub(before.cache_read_tokens),
            ),
        ];
        let cost = after.cost_microusd.saturating_sub(before.cost_microusd);
        let ends = result
            .state
            .status
            .is_terminal()
            .then(|| result.state.clone());
        match self
            .coordinator
            .commit(&claimed.claim, result, continue_with)
            .await
        {
            Ok(Commit::Committed {
                continued, added, ..
            }) => {
                metrics::counter!("ratchet_steps_committed_total").increment(1);
                metrics::histogram!("ratchet_step_duration_seconds", "instruction" => instruction)
                    .record(seconds);
                for (kind, tokens) in spent.into_iter().filter(|(_, n)| *n > 0) {
                    metrics::counter!("ratchet_model_tokens_total", "kind" => kind)
                        .increment(tokens);
                }
                if cost > 0 {
                    metrics::counter!("ratchet_model_cost_microdollars_total").increment(cost);
                }
                if let Some(ended) = ends {
                    ratchet_telemetry::run_ended(&ended, self.coordinator.now());
                }
                continued.map(|next| (next, added))
            }
            Ok(Commit::Stale(stale)) => {
                tracing::info!(run = %claimed.job.run_id, step = claimed.job.step_index, ?stale, "stale commit discarded");
                None
            }
            Err(error) => {
                self.back_off(claimed, &error.to_string()).await;
                None
            }
        }
    }

    /// Ends a run whose step was cut off (by a cancel or its deadline), keeping what its batch
    /// did (`cut_off_step`). `batch` is how the engine saw each call when it stopped, with the
    /// events the calls left; the intents say what any attempt of the step recorded — a
    /// `never` call with an intent and no outcome started, whatever this attempt saw.
    async fn end_cut_off(
        &self,
        claimed: &ClaimedStep,
        reason: StopReason,
        batch: Option<(Vec<CallEnding>, Vec<EventDraft>)>,
    ) -> Option<ClaimedStep> {
        let state = &claimed.state;
        let store = self.coordinator.store();
        let read = async {
            let intents = store.intents(&state.run_id, claimed.job.step_index).await?;
            // A cancel cuts the step off before the store records it: its transaction may
            // still be under way. One the store failed to record leaves the run to go on, and
            // the step is given back.
            let recorded = reason != StopReason::Cancelled || self.cancel_recorded(state).await?;
            Ok::<_, ratchet_store::Error>((intents, recorded))
        };
        let intents = match read.await {
            Ok((intents, true)) => intents,
            Ok((_, false)) => {
                self.back_off(claimed, "a cancel cut the step off but was not recorded")
                    .await;
                return None;
            }
            Err(error) => {
                self.back_off(claimed, &error.to_string()).await;
                return None;
            }
        };
        let (endings, call_events) = match batch {
            Some((endings, events)) => (Some(endings), events),
            None => (untold_endings(state, claimed.job.phase), Vec::new()),
        };
        let endings = endings.map(|endings| with_intents(endings, &intents));
        let mut result = cut_off_step(
            state.clone(),
            &claimed.job,
            reason,
            endings,
            self.coordinator.now(),
            self.coordinator.now(),
        );
        result.events.splice(0..0, call_events);
        self.commit(claimed, result, None)
            .await
            .map(|(next, _)| next)
    }

    /// Whether a cancel of the run is recorded, waiting up to `CANCEL_RECORDED` for the
    /// transaction of one that cut this process's step off before it committed.
    async fn cancel_recorded(
        &self,
        state: &ratchet_core::AgentState,
    ) -> Result<bool, ratchet_store::Error> {
        let until = tokio::time::Instant::now() + CANCEL_RECORDED;
        loop {
            if self
                .coordinator
                .store()
                .load_state(&state.run_id)
                .await?
                .cancel_requested
            {
                return Ok(true);
            }
            if tokio::time::Instant::now() >= until {
                return Ok(false);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Runs the step, renewing its lease, and cuts it off (cancelling its token: calls get
    /// their grace period, then are aborted) when the run's deadline passes or, after a grace
    /// period of its own, when the process shuts down.
    async fn execute_with_heartbeat(
        &self,
        claimed: &ClaimedStep,
        cancel: &CancellationToken,
    ) -> (Result<Executed, StepFailure>, Option<CutOff>) {
        let step_cancel = cancel.child_token();
        let step = self
            .engine
            .execute(claimed, &step_cancel, self.config.cancel_grace);
        tokio::pin!(step);
        // The first beat is one period from now. (An interval's immediate first tick is not
        // free: tokio rounds its deadline up to the timer's next millisecond, so awaiting it
        // held every step back by up to a millisecond.)
        let mut beat = tokio::time::interval_at(
            tokio::time::Instant::now() + self.config.heartbeat,
            self.config.heartbeat,
        );
        let until_deadline = claimed.state.deadline().map(|deadline| {
            Duration::from_millis(u64::try_from(deadline - self.coordinator.now()).unwrap_or(0))
        });
        let deadline = tokio::time::sleep(until_deadline.unwrap_or(Duration::MAX));
        tokio::pin!(deadline);
        let shutdown_grace = tokio::time::sleep(Duration::MAX);
        tokio::pin!(shutdown_grace);
        let mut watch =
            tokio::time::interval_at(tokio::time::Instant::now() + CANCEL_WATCH, CANCEL_WATCH);
        let mut draining = false;
        let mut cut_off = None;
        loop {
            tokio::select! {
                outcome = &mut step => return (outcome, cut_off),
                () = &mut deadline, if until_deadline.is_some() && cut_off.is_none() => {
                    tracing::info!(run = %claimed.job.run_id, step = claimed.job.step_index, "the run's deadline passed; cutting its step off");
                    cut_off = Some(CutOff::Deadline);
                    step_cancel.cancel();
                }
                () = self.shutdown.cancelled(), if !draining => {
                    draining = true;
                    let at = tokio::time::Instant::now() + self.config.cancel_grace;
                    shutdown_grace.as_mut().reset(at);
                }
                () = &mut shutdown_grace, if draining && cut_off.is_none() => {
                    tracing::info!(run = %claimed.job.run_id, step = claimed.job.step_index, "shutting down; cutting off a step that outlived the grace period");
                    cut_off = Some(CutOff::Shutdown);
                    step_cancel.cancel();
                }
                // A cancel accepted by another process reaches this one by the change stream
                // where the store has one; this read is the fallback that always works.
                _ = watch.tick(), if !cancel.is_cancelled() => {
                    match self.coordinator.store().load_state(&claimed.job.run_id).await {
                        Ok(state) if state.cancel_requested => {
                            tracing::info!(run = %claimed.job.run_id, step = claimed.job.step_index, "a cancel was accepted elsewhere; cutting the step off");
                            cancel.cancel();
                        }
                        Ok(_) => {}
                        Err(error) => tracing::warn!(%error, "reading the run's cancel flag failed"),
                    }
                }
                _ = beat.tick() => {
                    match self.coordinator.heartbeat(&claimed.claim, &self.lease()).await {
                        Ok(true) => {}
                        Ok(false) => return (Err(StepFailure::LeaseLost), cut_off),
                        Err(error) => tracing::warn!(%error, "heartbeat failed"),
                    }
                }
            }
        }
    }

    /// A failed model call is tried again later — after an exponential backoff with jitter,
    /// or the provider's `Retry-After` if longer — up to the run's `max_model_attempts`; then
    /// the run fails with `llm_error`.
    async fn retry_or_fail(
        &self,
        claimed: &ClaimedStep,
        message: String,
        attempt: u32,
        retry_after: Option<Duration>,
    ) -> Option<ClaimedStep> {
        let max = claimed.state.config.limits.max_model_attempts.max(1);
        let event = model_error_event(claimed, &message, Some(attempt), attempt >= max);
        if attempt >= max {
            let mut result = finish_step(
                claimed.state.clone(),
                &claimed.job,
                StopReason::LlmError,
                self.coordinator.now(),
                self.coordinator.now(),
            );
            result.events.insert(0, event);
            return self
                .commit(claimed, result, None)
                .await
                .map(|(next, _)| next);
        }
        let asked = retry_after.map_or(0, |wait| wait.as_millis() as i64);
        let at = self.coordinator.now() + self.jittered_backoff(attempt).max(asked);
        if let Err(error) = self
            .coordinator
            .retry_later(&claimed.claim, at, event)
            .await
        {
            tracing::warn!(%error, "could not schedule a retry; the lease will expire");
        }
        None
    }

    /// The store or the machine failed under the step: give the job back with a growing
    /// delay (by how often it has been claimed), so a persistent fault does not spin.
    async fn back_off(&self, claimed: &ClaimedStep, error: &str) {
        tracing::warn!(run = %claimed.job.run_id, step = claimed.job.step_index, %error, "step failed on infrastructure; it will be retried");
        let event = EventDraft::new(
            EventKind::Activity,
            json!({
                "run_id": claimed.job.run_id,
                "activity": "step_released",
                "step_index": claimed.job.step_index,
                "attempt": claimed.job.attempt,
                "error": error,
            }),
        );
        let at = self.coordinator.now() + self.backoff(claimed.job.attempt);
        if let Err(error) = self
            .coordinator
            .retry_later(&claimed.claim, at, event)
            .await
        {
            tracing::warn!(%error, "could not release the step; its lease will expire");
        }
    }

    /// `backoff` scaled by a random factor in [0.5, 1): retries of many runs that failed
    /// together do not hit the provider together again.
    fn jittered_backoff(&self, attempt: u32) -> i64 {
        use std::hash::{BuildHasher, RandomState};
        let random = RandomState::new().hash_one(self.coordinator.now()) % 1_000;
        self.backoff(attempt) * (500 + random as i64 / 2) / 1_000
    }

    /// `retry_backoff`, doubled per attempt after the first, at most 30 s.
    fn backoff(&self, attempt: u32) -> i64 {
        let doubled = self
            .config
            .retry_backoff
            .saturating_mul(1 << attempt.saturating_sub(1).min(10));
        doubled.min(Duration::from_secs(30)).as_millis() as i64
    }
}

/// What a failed model call reports: the provider's message, the attempt (when it was one of
/// several), and whether the run gives up on it.
fn model_error_event(
    claimed: &ClaimedStep,
    message: &str,
    attempt: Option<u32>,
    last: bool,
) -> EventDraft {
    EventDraft::new(
        EventKind::ModelError,
        json!({
            "run_id": claimed.job.run_id,
            "step_index": claimed.job.step_index,
            "attempt": attempt,
            "message": message,
            "final": last,
        }),
    )
}

/// Names the process that executed a step in its `step.committed` event (`"worker"`: the
/// lease owner, `host:pid:instance`): with several processes on one database, where each
/// step ran can be told afterwards.
fn sign(result: &mut ratchet_core::StepResult, owner: &str) {
    let committed = result
        .events
        .iter_mut()
        .filter(|e| e.kind == EventKind::StepCommitted);
    for event in committed {
        if let Some(payload) = event.payload.as_object_mut() {
            payload.insert("worker".to_owned(), json!(owner));
        }
    }
}
