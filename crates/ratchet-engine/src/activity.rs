//! The live activity bus: what the steps in flight in this process are doing right now
//! (`loading_context`, `calling_model`, `executing_tools`), for the event streams that follow
//! their sessions.
//!
//! Announcements are never written to the store and never get a `seq`: a step writes nothing
//! more because someone may be watching it, and a stream's replay of the stored backlog stays
//! exactly what was committed. So this bus is separate from the observation bus of stored
//! events, whose subscribers count on every event having been committed. An announcement
//! nobody hears, or one a slow subscriber misses, is simply gone; the next `step.committed`
//! says the step is over either way.

use std::collections::HashMap;
use std::sync::Mutex;

use ratchet_core::{Activity, Millis, RunId, SessionId};
use ratchet_store::{ClaimedStep, StoredEvent};
use serde_json::Value;
use tokio::sync::broadcast;

/// Announcements kept for a subscriber that has not read them; one that falls further behind
/// loses the oldest, which are stale by then anyway.
const BUFFER: usize = 1024;

/// One announcement of a step in flight.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveActivity {
    pub session_id: SessionId,
    pub run_id: RunId,
    /// The payload of the `activity` event: `run_id`, `activity`, `step_index`, and `model`
    /// or `tools` where the activity names them.
    pub payload: Value,
    /// When the step announced it, in ms since the epoch.
    pub at: Millis,
    /// How many stored events the Coordinator had published when this was announced: a
    /// stream that has taken exactly these from the observation bus sends it in the order it
    /// happened, after the commit before it and before the one after it.
    pub published_before: u64,
}

/// Both buses, subscribed together: `published` stored events were sent before `events`
/// was subscribed, so the subscriber's count of published events starts there. `in_flight`
/// is what the steps running at that moment last announced: a subscriber that joins while a
/// step runs learns what it is doing without waiting for its next announcement.
pub struct Observed {
    pub events: broadcast::Receiver<StoredEvent>,
    pub activity: broadcast::Receiver<LiveActivity>,
    pub published: u64,
    pub in_flight: Vec<LiveActivity>,
}

pub(crate) struct ActivityBus {
    sender: broadcast::Sender<LiveActivity>,
    /// The latest announcement of each run with a step in flight here. Locked only to read
    /// or replace one entry, never across an `.await`.
    in_flight: Mutex<HashMap<RunId, LiveActivity>>,
}

impl ActivityBus {
    pub(crate) fn new() -> ActivityBus {
        ActivityBus {
            sender: broadcast::channel(BUFFER).0,
            in_flight: Mutex::new(HashMap::new()),
        }
    }

    /// Subscribes, and takes what the steps in flight last announced. The caller holds the
    /// Coordinator's publication count, which `announce` is called under too, so nothing is
    /// announced between the two: every announcement is in the snapshot or on the receiver,
    /// never both.
    pub(crate) fn subscribe(&self) -> (broadcast::Receiver<LiveActivity>, Vec<LiveActivity>) {
        let receiver = self.sender.subscribe();
        let in_flight = self.in_flight().values().cloned().collect();
        (receiver, in_flight)
    }

    pub(crate) fn announce(
        &self,
        claimed: &ClaimedStep,
        activity: &Activity,
        published: u64,
        at: Millis,
    ) {
        let state = &claimed.state;
        let announced = LiveActivity {
            session_id: state.session_id.clone(),
            run_id: state.run_id.clone(),
            payload: activity.payload(state, claimed.job.step_index),
            at,
            published_before: published,
        };
        // No subscriber is the common case, not an error: nobody is watching, and the
        // announcement is only kept for a stream that joins mid-step.
        if self.sender.receiver_count() > 0 {
            let _ = self.sender.send(announced.clone());
        }
        self.in_flight().insert(state.run_id.clone(), announced);
    }

    /// The run's step is over here (committed, given back or dropped): it no longer does what
    /// it last announced.
    pub(crate) fn step_over(&self, run_id: &RunId) {
        self.in_flight().remove(run_id);
    }

    /// Whether `activity` is still what its run's step in flight last announced.
    pub(crate) fn still_in_flight(&self, activity: &LiveActivity) -> bool {
        self.in_flight().get(&activity.run_id) == Some(activity)
    }

    fn in_flight(&self) -> std::sync::MutexGuard<'_, HashMap<RunId, LiveActivity>> {
        self.in_flight.lock().unwrap_or_else(|e| e.into_inner())
    }
}
