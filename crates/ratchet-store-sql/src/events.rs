//! A session's events: appending them (numbered after the session's `last_seq`, their payloads
//! encoded by `payload`, announced once written) and reading them back, by session or by run.

use ratchet_core::{EventDraft, Millis, RunId, SessionId};
use ratchet_store::{Error, StoredEvent};

use crate::db::{Announcement, Db, Row};
use crate::rows::{parse_run_id, parse_session_id};
use crate::{Result, params};

pub(crate) fn insert_events(
    c: &dyn Db,
    session_id: &SessionId,
    run_id: Option<&RunId>,
    drafts: &[EventDraft],
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    if drafts.is_empty() {
        return Ok(Vec::new());
    }
    let last = c
        .query_opt(
            "UPDATE sessions SET last_seq = last_seq + ?2 WHERE id = ?1 RETURNING last_seq",
            &params![session_id.as_str(), drafts.len() as i64],
        )?
        .ok_or_else(|| Error::NotFound {
            kind: "session",
            id: session_id.to_string(),
        })?
        .int(0)?;
    let before = last - drafts.len() as i64;
    store_events(
        c,
        session_id,
        run_id,
        drafts.to_vec(),
        Vec::new(),
        before,
        now,
    )
}

/// `insert_events` for a caller that read the session's `last_seq` under its lock, which
/// no other transaction can move before this one ends. The first of `drafts` may come with
/// their payloads encoded already (`encoded`).
pub(crate) fn append_events(
    c: &dyn Db,
    session_id: &SessionId,
    run_id: Option<&RunId>,
    drafts: Vec<EventDraft>,
    encoded: Vec<String>,
    last_seq: i64,
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    if drafts.is_empty() {
        return Ok(Vec::new());
    }
    c.write(
        "UPDATE sessions SET last_seq = ?2 WHERE id = ?1",
        &params![session_id.as_str(), last_seq + drafts.len() as i64],
    )?;
    store_events(c, session_id, run_id, drafts, encoded, last_seq, now)
}

/// Writes the events after `before`, the session's `last_seq` before them; the first of
/// `drafts` with the payloads `encoded` already.
fn store_events(
    c: &dyn Db,
    session_id: &SessionId,
    run_id: Option<&RunId>,
    drafts: Vec<EventDraft>,
    encoded: Vec<String>,
    before: i64,
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    let first = before + 1;
    let count = drafts.len() as i64;
    let mut encoded = encoded.into_iter();
    let mut stored = Vec::with_capacity(drafts.len());
    for (seq, mut draft) in (first..).zip(drafts) {
        crate::payload::name_run(&mut draft.payload, run_id);
        let payload = match encoded.next() {
            Some(payload) => payload,
            None => crate::payload::encode(&draft.payload, run_id)?,
        };
        c.write(
            "INSERT INTO events (session_id, seq, run_id, kind, payload_json, created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            &params![
                session_id.as_str(),
                seq,
                run_id.map(|r| r.as_str()),
                draft.kind.as_str(),
                &payload,
                now
            ],
        )?;
        stored.push(StoredEvent {
            session_id: session_id.clone(),
            seq,
            run_id: run_id.cloned(),
            kind: draft.kind.as_str().to_owned(),
            payload: draft.payload,
            created_at: now,
        });
    }
    c.announce(Announcement::Events {
        session_id: session_id.as_str(),
        first_seq: first,
        last_seq: before + count,
    })?;
    Ok(stored)
}

pub(crate) const EVENT_COLUMNS: &str = "session_id, seq, run_id, kind, payload_json, created_at";

pub(crate) fn to_event(mut r: Row) -> Result<StoredEvent> {
    let run_id = r.opt_text(2)?.as_deref().map(parse_run_id).transpose()?;
    Ok(StoredEvent {
        session_id: parse_session_id(&r.text(0)?)?,
        seq: r.int(1)?,
        kind: r.text(3)?,
        payload: crate::payload::decode(&r.text(4)?, run_id.as_ref())?,
        run_id,
        created_at: r.int(5)?,
    })
}

pub(crate) fn events_after(
    c: &dyn Db,
    session_id: &SessionId,
    after_seq: i64,
    limit: u32,
) -> Result<Vec<StoredEvent>> {
    c.query(
        &format!(
            "SELECT {EVENT_COLUMNS} FROM events WHERE session_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3"
        ),
        &params![session_id.as_str(), after_seq, limit],
    )?
    .into_iter()
    .map(to_event)
    .collect()
}

/// Events after `after_seq` in `seq` order, at most `limit` of them, and no more than fit in
/// `max_bytes` of payload — but always the first, however large, so a page never stalls.
/// The page's end is found from each row's stored length alone, so no more payloads are read
/// than the page returns (a window over whole rows would buffer up to `limit` of them).
pub(crate) fn events_within(
    c: &dyn Db,
    session_id: &SessionId,
    after_seq: i64,
    limit: u32,
    max_bytes: u64,
) -> Result<Vec<StoredEvent>> {
    let max_bytes = i64::try_from(max_bytes).unwrap_or(i64::MAX);
    c.query(
        &format!(
            "SELECT {EVENT_COLUMNS} FROM events
             WHERE session_id = ?1 AND seq > ?2 AND seq <= (
                 SELECT COALESCE(MAX(seq), ?2) FROM (
                     SELECT seq, octet_length(payload_json) AS size,
                            SUM(octet_length(payload_json)) OVER (ORDER BY seq) - octet_length(payload_json) AS before
                     FROM events WHERE session_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3
                 ) AS page
                 WHERE before = 0 OR before + size <= ?4
             )
             ORDER BY seq"
        ),
        &params![session_id.as_str(), after_seq, limit, max_bytes],
    )?
    .into_iter()
    .map(to_event)
    .collect()
}

pub(crate) fn run_events_after(
    c: &dyn Db,
    run_id: &RunId,
    after_seq: i64,
    limit: u32,
) -> Result<Vec<StoredEvent>> {
    c.query(
        &format!(
            "SELECT {EVENT_COLUMNS} FROM events
             WHERE session_id = (SELECT session_id FROM runs WHERE id = ?1) AND seq > ?2 AND run_id = ?1
             ORDER BY seq LIMIT ?3"
        ),
        &params![run_id.as_str(), after_seq, limit],
    )?
    .into_iter()
    .map(to_event)
    .collect()
}
