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

use ratchet_core::{Activity, Millis, RunId, SessionId};
use ratchet_store::{ClaimedStep, StoredEvent};
use serde_json::Value;
use tokio::sync::broadcast;

use crate::now_ms;

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
/// was subscribed, so the subscriber's count of published events starts there.
pub struct Observed {
    pub events: broadcast::Receiver<StoredEvent>,
    pub activity: broadcast::Receiver<LiveActivity>,
    pub published: u64,
}

pub(crate) struct ActivityBus {
    sender: broadcast::Sender<LiveActivity>,
}

impl ActivityBus {
    pub(crate) fn new() -> ActivityBus {
        ActivityBus {
            sender: broadcast::channel(BUFFER).0,
        }
    }

    pub(crate) fn subscribe(&self) -> broadcast::Receiver<LiveActivity> {
        self.sender.subscribe()
    }

    pub(crate) fn announce(&self, claimed: &ClaimedStep, activity: &Activity, published: u64) {
        let state = &claimed.state;
        let announced = LiveActivity {
            session_id: state.session_id.clone(),
            run_id: state.run_id.clone(),
            payload: activity.payload(state, claimed.job.step_index),
            at: now_ms(),
            published_before: published,
        };
        // No subscriber is the common case, not an error: nobody is watching.
        let _ = self.sender.send(announced);
    }
}
