//! Steering: messages users send to a session's active run, waiting for its next model call
//! within the lanes' caps (`ratchet_core::bounds::admit_steer`), and taken into its history
//! at that boundary.

use ratchet_core::bounds::{Queued, SteerLane, SteerLimits, admit_steer};
use ratchet_core::{
    AgentState, Delivery, EventDraft, EventKind, InboxStatus, Message, Millis, Origin, RunId,
    SessionId,
};
use ratchet_store::{Error, NewRun, Result};
use serde_json::json;

use crate::tables::{SteerRow, Tables, duplicate};

impl Tables {
    /// Queues a user's message to steer `active`, the session's active run, under the caps
    /// that run was frozen with; refused with `SteerQueueFull`.
    pub(crate) fn queue_steer(&mut self, new: &NewRun, active: &RunId, now: Millis) -> Result<()> {
        let waiting = self
            .steers
            .iter()
            .filter(|s| s.session_id == new.session_id);
        let queued = Queued::of_sizes(waiting.map(|s| s.content.len()));
        let limits = self.run(active)?.config.steer;
        admit_steer(SteerLane::User, &limits, queued, bytes(&new.content))
            .map_err(|why| Error::SteerQueueFull(format!("session {}: {why}", new.session_id)))?;
        if self
            .steers
            .iter()
            .any(|s| s.message_id == new.message_id.as_str())
        {
            return Err(duplicate("steer", &new.message_id));
        }
        self.steers.push(SteerRow {
            message_id: new.message_id.as_str().to_owned(),
            session_id: new.session_id.clone(),
            run_id: new.run_id.clone(),
            content: new.content.clone(),
            config: new.config.clone(),
            created_at: now,
        });
        Ok(())
    }

    /// Whether a background run's steered signal of `payload_bytes` may wait for the root
    /// session's next model call, under the caps frozen with `limits`; the refusal is for the
    /// model that sent it.
    pub(crate) fn admit_agent_steer(
        &self,
        root: &SessionId,
        limits: &SteerLimits,
        payload_bytes: usize,
    ) -> Result<(), String> {
        let waiting = (self.inbox.iter()).filter(|e| {
            e.session_id == *root
                && e.status == InboxStatus::Pending
                && e.delivery == Delivery::Steer
        });
        let sizes = waiting.map(|e| e.payload.as_ref().map_or(0, |p| p.to_string().len()));
        let payload_bytes = u64::try_from(payload_bytes).unwrap_or(u64::MAX);
        admit_steer(
            SteerLane::Agent,
            limits,
            Queued::of_sizes(sizes),
            payload_bytes,
        )
    }

    /// Takes the session's waiting steers out of their queue, oldest first.
    pub(crate) fn take_steers(&mut self, session_id: &SessionId) -> Vec<SteerRow> {
        let (taken, left) = std::mem::take(&mut self.steers)
            .into_iter()
            .partition(|s| s.session_id == *session_id);
        self.steers = left;
        taken
    }

    /// The run's next step calls the model: the session's waiting steers join its history now.
    pub(crate) fn absorb_steers(
        &mut self,
        state: &AgentState,
        added: &mut Vec<Message>,
        now: Millis,
    ) -> Result<Vec<EventDraft>> {
        let mut drafts = Vec::new();
        for steer in self.take_steers(&state.session_id) {
            let message = Message {
                origin: Origin::Steer,
                ..Message::user(steer.content.clone())
            };
            self.insert_message(&steer.message_id, state, message.clone(), now)?;
            added.push(message);
            drafts.push(EventDraft::new(
                EventKind::MessageSteered,
                json!({"run_id": state.run_id, "message_id": steer.message_id, "content": steer.content}),
            ));
        }
        Ok(drafts)
    }
}

fn bytes(text: &str) -> u64 {
    u64::try_from(text.len()).unwrap_or(u64::MAX)
}
