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
use ratchet_store::ClaimedStep;
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

    pub(crate) fn announce(&self, claimed: &ClaimedStep, activity: &Activity) {
        let state = &claimed.state;
        let announced = LiveActivity {
            session_id: state.session_id.clone(),
            run_id: state.run_id.clone(),
            payload: activity.payload(state, claimed.job.step_index),
            at: now_ms(),
        };
        // No subscriber is the common case, not an error: nobody is watching.
        let _ = self.sender.send(announced);
    }
}
