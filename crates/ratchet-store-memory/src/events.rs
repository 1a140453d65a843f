//! Each session's event log: seqs 1, 2, 3, … with no gap, appended under the store's one
//! lock, so writers racing on a session still number its events densely.

use ratchet_core::{EventDraft, Millis, RunId, SessionId};
use ratchet_store::{Result, StoredEvent};
use serde_json::{Map, Value};

use crate::tables::Tables;

const RUN_ID: &str = "run_id";

impl Tables {
    /// Appends `drafts` to the session's log as events of `run_id`. A run's event names its
    /// run: an object payload without `run_id` gains it.
    pub(crate) fn insert_events(
        &mut self,
        session_id: &SessionId,
        run_id: Option<&RunId>,
        drafts: Vec<EventDraft>,
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        if drafts.is_empty() {
            return Ok(Vec::new());
        }
        let log = &mut self.session_mut(session_id)?.events;
        let mut stored = Vec::with_capacity(drafts.len());
        for draft in drafts {
            let mut payload = draft.payload;
            if let (Some(run), Value::Object(fields)) = (run_id, &mut payload)
                && !fields.contains_key(RUN_ID)
            {
                fields.insert(RUN_ID.to_owned(), Value::String(run.as_str().to_owned()));
            }
            let event = StoredEvent {
                session_id: session_id.clone(),
                seq: seq_after(log.len()),
                run_id: run_id.cloned(),
                kind: draft.kind.as_str().to_owned(),
                payload,
                created_at: now,
            };
            log.push(event.clone());
            stored.push(event);
        }
        Ok(stored)
    }

    /// The session's events after `after_seq`, in order; none for a session that does not
    /// exist.
    pub(crate) fn events_after(
        &self,
        session_id: &SessionId,
        after_seq: i64,
        limit: u32,
    ) -> Vec<StoredEvent> {
        self.log_after(session_id, after_seq)
            .iter()
            .take(limit as usize)
            .cloned()
            .collect()
    }

    /// `events_after`, stopping before the payloads would pass `max_bytes`, but never before
    /// the first event.
    pub(crate) fn events_within(
        &self,
        session_id: &SessionId,
        after_seq: i64,
        limit: u32,
        max_bytes: u64,
    ) -> Vec<StoredEvent> {
        let mut page = Vec::new();
        let mut bytes: u64 = 0;
        for event in self
            .log_after(session_id, after_seq)
            .iter()
            .take(limit as usize)
        {
            bytes = bytes.saturating_add(stored_size(event));
            if !page.is_empty() && bytes > max_bytes {
                break;
            }
            page.push(event.clone());
        }
        page
    }

    /// One run's events after `after_seq`, in order.
    pub(crate) fn run_events_after(
        &self,
        run_id: &RunId,
        after_seq: i64,
        limit: u32,
    ) -> Vec<StoredEvent> {
        let Some(run) = self.runs.get(run_id) else {
            return Vec::new();
        };
        self.log_after(&run.session_id, after_seq)
            .iter()
            .filter(|event| event.run_id.as_ref() == Some(run_id))
            .take(limit as usize)
            .cloned()
            .collect()
    }

    /// The session's event `seq`.
    pub(crate) fn event(&self, session_id: &SessionId, seq: i64) -> Option<&StoredEvent> {
        let index = usize::try_from(seq.checked_sub(1)?).ok()?;
        self.sessions.get(session_id)?.events.get(index)
    }

    fn log_after(&self, session_id: &SessionId, after_seq: i64) -> &[StoredEvent] {
        let log = self
            .sessions
            .get(session_id)
            .map_or(&[][..], |s| &s.events[..]);
        let skip = usize::try_from(after_seq.max(0)).unwrap_or(usize::MAX);
        log.get(skip..).unwrap_or_default()
    }
}

/// The seq of the event after `count` events.
pub(crate) fn seq_after(count: usize) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX).saturating_add(1)
}

/// The bytes an event's payload counts for a page's budget: its JSON as the SQL backends
/// store it, without the `run_id` that the event's own run already says. Counting the same
/// bytes, a page ends at the same event here as there.
fn stored_size(event: &StoredEvent) -> u64 {
    let stored = match (&event.run_id, &event.payload) {
        (Some(run), Value::Object(fields))
            if fields
                .get(RUN_ID)
                .is_none_or(|named| named.as_str() == Some(run.as_str())) =>
        {
            let without: Map<String, Value> = (fields.iter())
                .filter(|(key, _)| key.as_str() != RUN_ID)
                .map(|(key, value)| (key.clone(), value.clone()))
                .collect();
            Value::Object(without).to_string()
        }
        (_, payload) => payload.to_string(),
    };
    u64::try_from(stored.len()).unwrap_or(u64::MAX)
}
