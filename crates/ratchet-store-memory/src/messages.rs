//! Messages: written once and never changed, except that a continuation turn's drafts join
//! their session's history when the turn completes. What each reader is shown of them
//! (clients, the model at a step) is derived here.

use ratchet_core::{AgentState, Message, Millis, RunId, SessionId, Visibility};
use ratchet_store::{Result, StepMessages, StoredMessage, split_step_messages};

use crate::tables::{MessageRow, Tables, duplicate};

impl Tables {
    /// Writes `message` under `id` into the session and run `state` names; a continuation
    /// turn's message is a draft of its run.
    pub(crate) fn insert_message(
        &mut self,
        id: &str,
        state: &AgentState,
        message: Message,
        now: Millis,
    ) -> Result<()> {
        if self.messages.iter().any(|m| m.id == id) {
            return Err(duplicate("message", id));
        }
        self.messages.push(MessageRow {
            id: id.to_owned(),
            session_id: state.session_id.clone(),
            run_id: state.run_id.clone(),
            message,
            created_at: now,
            draft_of: state.config.continuation.then(|| state.run_id.clone()),
        });
        Ok(())
    }

    /// The session's messages with their positions, in order.
    fn session_messages<'a>(
        &'a self,
        session_id: &'a SessionId,
    ) -> impl Iterator<Item = (i64, &'a MessageRow)> + 'a {
        (1..)
            .zip(&self.messages)
            .filter(move |(_, m)| m.session_id == *session_id)
    }

    pub(crate) fn visible_messages(
        &self,
        session_id: &SessionId,
        after_position: i64,
        limit: u32,
    ) -> Vec<StoredMessage> {
        self.session_messages(session_id)
            .filter(|(position, m)| {
                *position > after_position
                    && m.draft_of.is_none()
                    && m.message.visibility == Visibility::Visible
            })
            .take(limit as usize)
            .map(stored)
            .collect()
    }

    /// The session's messages as stored, in order, hidden ones included, drafts not.
    pub(crate) fn stored_history(&self, session_id: &SessionId) -> Vec<StoredMessage> {
        self.session_messages(session_id)
            .filter(|(_, m)| m.draft_of.is_none())
            .map(stored)
            .collect()
    }

    /// Everything the session's history holds, hidden messages included, drafts not.
    pub(crate) fn history(&self, session_id: &SessionId) -> Vec<Message> {
        self.session_messages(session_id)
            .filter(|(_, m)| m.draft_of.is_none())
            .map(|(_, m)| m.message.clone())
            .collect()
    }

    pub(crate) fn context(&self, session_id: &SessionId, run: &RunId) -> Vec<StoredMessage> {
        self.context_through(session_id, run, i64::MAX)
    }

    /// What the model saw in `run`'s turn when the session's messages ended at position
    /// `through`: the latest summary in place of every message before the first one it keeps,
    /// then the messages from there on (other turns' drafts left out, the run's own kept).
    fn context_through(
        &self,
        session_id: &SessionId,
        run: &RunId,
        through: i64,
    ) -> Vec<StoredMessage> {
        let seen: Vec<(i64, &MessageRow)> = self
            .session_messages(session_id)
            .filter(|(position, m)| {
                *position <= through && m.draft_of.as_ref().is_none_or(|draft| draft == run)
            })
            .collect();
        let kept_from = (seen.iter())
            .filter_map(|(_, m)| m.message.keeps_from)
            .max()
            .unwrap_or(0);
        let mut shown: Vec<StoredMessage> = (seen.into_iter())
            .filter(|(position, _)| *position >= kept_from)
            .map(stored)
            .collect();
        // Only the latest summary stands, and it leads.
        if let Some(latest) = shown.iter().rposition(|m| m.message.keeps_from.is_some()) {
            let summary = shown.remove(latest);
            shown.retain(|m| m.message.keeps_from.is_none());
            shown.insert(0, summary);
        }
        shown
    }

    /// What `run` showed the model at step `step_index` and what that step wrote. While a run
    /// is active only its own commits add to its session, and a step's messages are named
    /// after it, so the step's context ends just before the first message of this step or a
    /// later one — with none, at the run's last message.
    pub(crate) fn step_messages(&self, run_id: &RunId, step_index: u64) -> Result<StepMessages> {
        let session_id = &self.run(run_id)?.session_id;
        let runs_messages: Vec<StoredMessage> = (self.session_messages(session_id))
            .filter(|(_, m)| m.run_id == *run_id)
            .map(stored)
            .collect();
        let Some((through, written)) = split_step_messages(runs_messages, run_id, step_index)
        else {
            return Ok(StepMessages::default());
        };
        Ok(StepMessages {
            context: self.context_through(session_id, run_id, through),
            written,
        })
    }
}

fn stored((position, row): (i64, &MessageRow)) -> StoredMessage {
    StoredMessage {
        id: row.id.clone(),
        run_id: row.run_id.clone(),
        position,
        message: row.message.clone(),
        created_at: row.created_at,
    }
}
