//! The worker pool: tasks that claim step jobs, run them through the Engine while renewing
//! their lease, and hand the results to the Coordinator.
//!
//! Jobs live in the store's outbox, not in memory: a wake-up only says "look now", and a
//! periodic poll finds whatever a wake-up missed. A worker that commits a step takes the
//! run's next job in the same transaction and goes on with it, up to `max_streak` steps.

use std::sync::Arc;
use std::time::Duration;

use ratchet_core::step::finish_step;
use ratchet_core::{EventDraft, EventKind, StopReason};
use ratchet_store::{ClaimedStep, Commit, Lease};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use crate::{Coordinator, Engine, PoolConfig, StepFailure, now_ms};

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
                // One worker of the pool looks for due continuations: the others would only
                // repeat its query.
                serves_inboxes: index == 0 && config.only_run.is_none(),
                coordinator: Arc::clone(&coordinator),
                engine: Arc::clone(&engine),
                config: config.clone(),
                owner: owner.clone(),
                shutdown: shutdown.clone(),
            };
            tracker.spawn(worker.run());
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
            expires_at: now_ms() + self.config.lease.as_millis() as i64,
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

    /// Runs one step to its commit; returns the run's next step when this worker holds it.
    async fn run_step(
        &self,
        claimed: ClaimedStep,
        cancel: &CancellationToken,
        may_continue: bool,
    ) -> Option<ClaimedStep> {
        let outcome = self.execute_with_heartbeat(&claimed, cancel).await;
        let finish = |reason| {
            finish_step(
                claimed.state.clone(),
                &claimed.job,
                reason,
                now_ms(),
                now_ms(),
            )
        };
        let result = match outcome {
            Ok(result) => result,
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
                result
            }
            // Only a cancel request cancels a run's token or refuses its intents; the store
            // already marked the run `cancelling`, so this step ends it.
            Err(StepFailure::Cancelled) => finish(StopReason::Cancelled),
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
        self.commit(&claimed, result, continue_with).await
    }

    async fn commit(
        &self,
        claimed: &ClaimedStep,
        mut result: ratchet_core::StepResult,
        continue_with: Option<Lease>,
    ) -> Option<ClaimedStep> {
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
        ];
        let cost = after.cost_microusd.saturating_sub(before.cost_microusd);
        match self
            .coordinator
            .commit(&claimed.claim, result, continue_with)
            .await
        {
            Ok(Commit::Committed { continued, .. }) => {
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
                continued
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

    async fn execute_with_heartbeat(
        &self,
        claimed: &ClaimedStep,
        cancel: &CancellationToken,
    ) -> Result<ratchet_core::StepResult, StepFailure> {
        let step = self.engine.execute(claimed, cancel);
        tokio::pin!(step);
        let mut beat = tokio::time::interval(self.config.heartbeat);
        beat.tick().await;
        loop {
            tokio::select! {
                outcome = &mut step => return outcome,
                _ = beat.tick() => {
                    match self.coordinator.heartbeat(&claimed.claim, &self.lease()).await {
                        Ok(true) => {}
                        Ok(false) => return Err(StepFailure::LeaseLost),
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
                now_ms(),
                now_ms(),
            );
            result.events.insert(0, event);
            return self.commit(claimed, result, None).await;
        }
        let asked = retry_after.map_or(0, |wait| wait.as_millis() as i64);
        let at = now_ms() + self.jittered_backoff(attempt).max(asked);
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
        let at = now_ms() + self.backoff(claimed.job.attempt);
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
        let random = RandomState::new().hash_one(now_ms()) % 1_000;
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
