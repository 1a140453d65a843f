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

/// True when `owner` names a process on this host that no longer runs.
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
    this_host.is_ok_and(|h| h == host)
        && pid != std::process::id()
        && !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

pub struct WorkerPool {
    shutdown: CancellationToken,
    tracker: TaskTracker,
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
        for _ in 0..config.workers.max(1) {
            let worker = Worker {
                coordinator: Arc::clone(&coordinator),
                engine: Arc::clone(&engine),
                config: config.clone(),
                owner: owner.clone(),
                shutdown: shutdown.clone(),
            };
            tracker.spawn(worker.run());
        }
        tracker.close();
        WorkerPool { shutdown, tracker }
    }

    /// Stops claiming and waits for in-flight steps to commit.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        self.tracker.wait().await;
    }
}

struct Worker {
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
        while !self.shutdown.is_cancelled() {
            match self.coordinator.claim_next(self.lease()).await {
                Ok(Some(claimed)) => {
                    // Another job may be waiting behind this one: pass the wake-up on.
                    self.coordinator.wake_one();
                    self.run_streak(claimed).await;
                }
                Ok(None) => {
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

    async fn run_streak(&self, first: ClaimedStep) {
        let mut current = Some(first);
        let mut streak = 0;
        while let Some(claimed) = current.take() {
            streak += 1;
            let may_continue = streak < self.config.max_streak && !self.shutdown.is_cancelled();
            current = self.run_step(claimed, may_continue).await;
        }
    }

    /// Runs one step to its commit; returns the run's next step when this worker holds it.
    async fn run_step(&self, claimed: ClaimedStep, may_continue: bool) -> Option<ClaimedStep> {
        let run_id = claimed.job.run_id.clone();
        let cancel = self.coordinator.step_started(&run_id);
        let outcome = self.execute_with_heartbeat(&claimed, &cancel).await;
        self.coordinator.step_ended(&run_id);
        let continue_with = may_continue.then(|| self.lease());
        let result = match outcome {
            Ok(result) => result,
            Err(StepFailure::Transient(message)) => {
                return self.retry_or_fail(claimed, message).await;
            }
            Err(StepFailure::Fatal(message)) => {
                tracing::warn!(run = %run_id, %message, "model call failed for good");
                finish_step(
                    claimed.state.clone(),
                    &claimed.job,
                    StopReason::ModelError,
                    now_ms(),
                    now_ms(),
                )
            }
            // Only a cancel request cancels a step's token; the store already marked the run
            // `cancelling`, so this step ends it.
            Err(StepFailure::Cancelled) => finish_step(
                claimed.state.clone(),
                &claimed.job,
                StopReason::Cancelled,
                now_ms(),
                now_ms(),
            ),
            Err(StepFailure::LeaseLost) => return None,
            Err(StepFailure::Infrastructure(error)) => {
                tracing::warn!(run = %run_id, %error, "step failed on infrastructure; it will be retried");
                let _ = self.release(&claimed).await;
                return None;
            }
        };
        self.commit(&claimed, result, continue_with).await
    }

    async fn commit(
        &self,
        claimed: &ClaimedStep,
        result: ratchet_core::StepResult,
        continue_with: Option<Lease>,
    ) -> Option<ClaimedStep> {
        match self
            .coordinator
            .commit(&claimed.claim, result, continue_with)
            .await
        {
            Ok(Commit::Committed { continued, .. }) => continued,
            Ok(Commit::Stale(stale)) => {
                tracing::info!(run = %claimed.job.run_id, step = claimed.job.step_index, ?stale, "stale commit discarded");
                None
            }
            Err(error) => {
                tracing::warn!(run = %claimed.job.run_id, %error, "commit failed; the job stays for another attempt");
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
                        Ok(false) => {
                            tracing::warn!(run = %claimed.job.run_id, "lease lost mid-step; abandoning it");
                            cancel.cancel();
                            return Err(StepFailure::LeaseLost);
                        }
                        Err(error) => tracing::warn!(%error, "heartbeat failed"),
                    }
                }
            }
        }
    }

    async fn retry_or_fail(&self, claimed: ClaimedStep, message: String) -> Option<ClaimedStep> {
        let attempt = claimed.job.attempt;
        let max = claimed.state.config.limits.max_model_attempts.max(1);
        let event = EventDraft::new(
            EventKind::ModelError,
            json!({"run_id": claimed.job.run_id, "step_index": claimed.job.step_index, "attempt": attempt, "message": message, "final": attempt >= max}),
        );
        if attempt >= max {
            let mut result = finish_step(
                claimed.state.clone(),
                &claimed.job,
                StopReason::ModelError,
                now_ms(),
                now_ms(),
            );
            result.events.insert(0, event);
            return self.commit(&claimed, result, None).await;
        }
        let backoff = self
            .config
            .retry_backoff
            .saturating_mul(1 << (attempt.saturating_sub(1)).min(5));
        let at = now_ms() + backoff.min(Duration::from_secs(30)).as_millis() as i64;
        match self
            .coordinator
            .retry_later(&claimed.claim, at, event)
            .await
        {
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(%error, "could not schedule a retry; the lease will expire")
            }
        }
        None
    }

    async fn release(&self, claimed: &ClaimedStep) -> crate::Result<bool> {
        let event = EventDraft::new(
            EventKind::Activity,
            json!({"run_id": claimed.job.run_id, "activity": "step_released", "step_index": claimed.job.step_index}),
        );
        self.coordinator
            .retry_later(&claimed.claim, now_ms(), event)
            .await
    }
}
