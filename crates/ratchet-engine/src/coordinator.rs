//! The Coordinator: the only writer of run state and the only publisher to both buses.
//!
//! Every write goes through the store in one transaction; events are broadcast only after
//! that transaction has committed, and new jobs wake the workers only then. Observers may
//! lag or drop events (they replay from the store); the execution path never waits on them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ratchet_core::{MessageId, RunConfigSnapshot, RunId, RunStatus, SessionId, StepResult};
use ratchet_store::{CancelOutcome, Claim, ClaimedStep, Commit, Lease, NewRun, Store, StoredEvent};
use tokio::sync::{Notify, broadcast};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::{Result, now_ms};

/// Live events; a subscriber that falls this far behind is told it lagged and replays.
const EVENT_BUFFER: usize = 8192;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartedRun {
    pub session_id: SessionId,
    pub run_id: RunId,
    pub message_id: MessageId,
    pub status: RunStatus,
}

pub struct Coordinator {
    store: Arc<dyn Store>,
    events: broadcast::Sender<StoredEvent>,
    wake: Notify,
    in_flight: Mutex<HashMap<RunId, CancellationToken>>,
}

fn fresh_suffix() -> String {
    Uuid::now_v7().simple().to_string()
}

impl Coordinator {
    pub fn new(store: Arc<dyn Store>) -> Arc<Coordinator> {
        Arc::new(Coordinator {
            store,
            events: broadcast::channel(EVENT_BUFFER).0,
            wake: Notify::new(),
            in_flight: Mutex::new(HashMap::new()),
        })
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The observation bus. Subscribe before acting to see every event of the action.
    pub fn subscribe(&self) -> broadcast::Receiver<StoredEvent> {
        self.events.subscribe()
    }

    pub async fn create_session(&self) -> Result<SessionId> {
        let id = SessionId::from_suffix(&fresh_suffix())
            .map_err(|e| crate::Error::Invalid(e.to_string()))?;
        self.store.create_session(&id, now_ms()).await?;
        Ok(id)
    }

    /// Records a user message and its run; the run starts now or queues behind the session's
    /// active run.
    pub async fn submit(
        &self,
        session_id: &SessionId,
        content: String,
        config: RunConfigSnapshot,
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
        };
        let submitted = self.store.submit_message(new, now_ms()).await?;
        self.publish(submitted.events);
        if submitted.status == RunStatus::Running {
            self.wake.notify_one();
        }
        Ok(StartedRun {
            session_id: session_id.clone(),
            run_id,
            message_id,
            status: submitted.status,
        })
    }

    pub async fn claim_next(&self, lease: Lease) -> Result<Option<ClaimedStep>> {
        Ok(self.store.claim_next(lease, now_ms()).await?)
    }

    pub async fn heartbeat(&self, claim: &Claim, lease: &Lease) -> Result<bool> {
        Ok(self.store.heartbeat(claim, lease.expires_at).await?)
    }

    pub async fn commit(
        &self,
        claim: &Claim,
        result: StepResult,
        continue_with: Option<Lease>,
    ) -> Result<Commit> {
        let commit = self
            .store
            .commit_step(claim, result, continue_with, now_ms())
            .await?;
        if let Commit::Committed {
            events, enqueued, ..
        } = &commit
        {
            self.publish(events.clone());
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
            .store
            .retry_later(claim, available_at, event, now_ms())
            .await?;
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
            .store
            .append_events(session_id, run_id, events, now_ms())
            .await?;
        self.publish(stored);
        Ok(())
    }

    /// Records write-ahead intents with the events that announce them, in one transaction.
    pub async fn record_intents(
        &self,
        session_id: &SessionId,
        intents: Vec<ratchet_store::Intent>,
        events: Vec<ratchet_core::EventDraft>,
    ) -> Result<()> {
        let stored = self
            .store
            .record_intents(session_id, intents, events, now_ms())
            .await?;
        self.publish(stored);
        Ok(())
    }

    /// Cancels a run: at once when it has no step in flight, otherwise by marking it
    /// `cancelling` and cancelling the step running in this process.
    pub async fn request_cancel(&self, run_id: &RunId) -> Result<CancelOutcome> {
        let outcome = self.store.request_cancel(run_id, now_ms()).await?;
        match &outcome {
            CancelOutcome::Cancelled { events, enqueued } => {
                self.publish(events.clone());
                if *enqueued {
                    self.wake.notify_one();
                }
            }
            CancelOutcome::Cancelling { events } => {
                self.publish(events.clone());
                if let Some(token) = self
                    .in_flight
                    .lock()
                    .ok()
                    .and_then(|m| m.get(run_id).cloned())
                {
                    token.cancel();
                }
            }
            CancelOutcome::AlreadyTerminal(_) => {}
        }
        Ok(outcome)
    }

    /// Releases the leases of processes on this machine that no longer exist, so their steps
    /// are taken over now instead of after lease expiry. Returns how many jobs were freed.
    pub async fn recover(&self, is_dead: impl Fn(&str) -> bool) -> Result<u64> {
        let mut released = 0;
        for owner in self.store.lease_owners().await? {
            if is_dead(&owner) {
                released += self.store.release_leases(&owner).await?;
            }
        }
        self.wake.notify_waiters();
        Ok(released)
    }

    pub(crate) async fn woken(&self) {
        self.wake.notified().await;
    }

    pub(crate) fn wake_one(&self) {
        self.wake.notify_one();
    }

    pub(crate) fn step_started(&self, run_id: &RunId) -> CancellationToken {
        let token = CancellationToken::new();
        if let Ok(mut in_flight) = self.in_flight.lock() {
            in_flight.insert(run_id.clone(), token.clone());
        }
        token
    }

    pub(crate) fn step_ended(&self, run_id: &RunId) {
        if let Ok(mut in_flight) = self.in_flight.lock() {
            in_flight.remove(run_id);
        }
    }

    fn publish(&self, events: Vec<StoredEvent>) {
        for event in events {
            // No subscriber is not an error: events are durable and replayable.
            let _ = self.events.send(event);
        }
    }
}
