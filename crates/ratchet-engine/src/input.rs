//! New input for a root run's session, as `sleep` waits for it: a queued user message, a
//! steer, an inbox report. The store says what is waiting; the event bus (which carries other
//! processes' events too, when the store hears them) says when to look again, and a short
//! poll covers what it does not announce.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ratchet_core::{Millis, SessionId};
use ratchet_tools::InputWatch;
use serde_json::Value;
use tokio::sync::broadcast::error::RecvError;

use crate::Coordinator;

/// How often the store is asked again when nothing was heard.
const RECHECK: Duration = Duration::from_millis(250);

pub(crate) struct SessionInput {
    coordinator: Arc<Coordinator>,
    session: SessionId,
    /// When the model asked for the batch the `sleep` is in (see `PendingInput::wakes`).
    asked_at: Option<Millis>,
}

impl SessionInput {
    pub(crate) fn new(
        coordinator: Arc<Coordinator>,
        session: SessionId,
        asked_at: Option<Millis>,
    ) -> SessionInput {
        SessionInput {
            coordinator,
            session,
            asked_at,
        }
    }
}

impl std::fmt::Debug for SessionInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionInput")
            .field("session", &self.session)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl InputWatch for SessionInput {
    async fn arrived(&self) -> Value {
        // Listening starts before the first look, so that nothing arriving in between is missed.
        let mut events = self.coordinator.subscribe();
        loop {
            match self
                .coordinator
                .store()
                .pending_input(&self.session, self.coordinator.now())
                .await
            {
                Ok(waiting) if waiting.wakes(self.asked_at) => {
                    return serde_json::to_value(waiting).unwrap_or_default();
                }
                Ok(_) => {}
                Err(error) => tracing::warn!(%error, "cannot read a session's waiting input"),
            }
            let heard = async {
                loop {
                    match events.recv().await {
                        Ok(event) if event.session_id == self.session => return,
                        Ok(_) => {}
                        Err(RecvError::Lagged(_)) => return,
                        Err(RecvError::Closed) => std::future::pending::<()>().await,
                    }
                }
            };
            tokio::select! {
                () = heard => {}
                () = tokio::time::sleep(RECHECK) => {}
            }
        }
    }
}
