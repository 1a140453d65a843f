//! The observation plane's transaction bodies: webhooks, the cursors that follow each
//! session's events for each webhook, and the deliveries queued from them.
//!
//! They write only these three tables. Every delivery status change goes through
//! `DeliveryStatus::edge` first. A signing secret is sealed before it is written and opened
//! only to hand a claimed attempt its key (`ratchet_store::secrets`).

use ratchet_core::{DeliveryStatus, Millis, WebhookId};
use ratchet_store::{
    AttemptOutcome, ClaimedDelivery, DeliveryBounds, DeliveryClaim, Effect, Error, Keyring,
    NewWebhook, RequestMark, Webhook, WebhookDelivery,
};

use crate::db::{Db, Row};
use crate::events::{EVENT_COLUMNS, to_event};
use crate::rows::{corrupt, from_json, parse_session_id, to_json};
use crate::{Result, params};

const OPEN: &str = "('pending', 'delivering')";

const WEBHOOK_COLUMNS: &str = "id, tenant, url, events_json, max_attempts, created_at";

fn to_webhook(mut r: Row) -> Result<Webhook> {
    Ok(Webhook {
        id: WebhookId::parse(&r.text(0)?).map_err(corrupt)?,
        tenant: r.text(1)?,
        url: r.text(2)?,
        events: r
            .opt_text(3)?
            .map(|text| from_json(&text, "webhook events"))
            .transpose()?,
        max_attempts: count_of(r.int(4)?)?,
        created_at: r.int(5)?,
    })
}

fn count_of(value: i64) -> Result<u32> {
    u32::try_from(value).map_err(|_| Error::Corrupt(format!("expected a count, found {value}")))
}

fn not_found(id: &WebhookId) -> Error {
    Error::NotFound {
        kind: "webhook",
        id: id.to_string(),
    }
}

pub(crate) fn create_webhook(
    c: &dyn Db,
    keyring: &Keyring,
    new: NewWebhook,
    now: Millis,
) -> Result<Webhook> {
    let events = new.events.as_ref().map(to_json).transpose()?;
    let secret = keyring.seal(new.id.as_str(), &new.secret)?;
    let inserted = c.execute(
        "INSERT INTO webhooks (id, tenant, url, events_json, secret, max_attempts, created_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) ON CONFLICT (id) DO NOTHING",
        &params![
            new.id.as_str(),
            &new.tenant,
            &new.url,
            events.as_deref(),
            &secret,
            new.max_attempts,
            now
        ],
    )?;
    if inserted == 0 {
        return Err(Error::Conflict(format!(
            "webhook {} already exists",
            new.id
        )));
    }
    // What was written before the webhook existed is not sent to it.
    c.execute(
        "INSERT INTO webhook_cursors (webhook_id, session_id, seq)
         SELECT ?1, id, last_seq FROM sessions WHERE tenant = ?2 AND last_seq > 0",
        &params![new.id.as_str(), &new.tenant],
    )?;
    if let Some(mark) = &new.request {
        let effect = Effect::WebhookCreated {
            webhook_id: new.id.clone(),
        };
        crate::requests::record_effect(c, mark, &effect)?;
    }
    get_webhook(c, &new.id)
}

pub(crate) fn get_webhook(c: &dyn Db, id: &WebhookId) -> Result<Webhook> {
    c.query_opt(
        &format!("SELECT {WEBHOOK_COLUMNS} FROM webhooks WHERE id = ?1"),
        &params![id.as_str()],
    )?
    .map(to_webhook)
    .transpose()?
    .ok_or_else(|| not_found(id))
}

pub(crate) fn webhooks(c: &dyn Db, tenant: &str) -> Result<Vec<Webhook>> {
    c.query(
        &format!(
            "SELECT {WEBHOOK_COLUMNS} FROM webhooks WHERE tenant = ?1 ORDER BY created_at, id"
        ),
        &params![tenant],
    )?
    .into_iter()
    .map(to_webhook)
    .collect()
}

pub(crate) fn delete_webhook(c: &dyn Db, id: &WebhookId) -> Result<()> {
    let deleted = c.execute("DELETE FROM webhooks WHERE id = ?1", &params![id.as_str()])?;
    if deleted == 0 {
        return Err(not_found(id));
    }
    c.execute(
        "DELETE FROM webhook_deliveries WHERE webhook_id = ?1",
        &params![id.as_str()],
    )?;
    c.execute(
        "DELETE FROM webhook_cursors WHERE webhook_id = ?1",
        &params![id.as_str()],
    )?;
    Ok(())
}

pub(crate) fn rotate_webhook_secret(
    c: &dyn Db,
    keyring: &Keyring,
    id: &WebhookId,
    secret: &str,
    request: Option<RequestMark>,
) -> Result<()> {
    let sealed = keyring.seal(id.as_str(), secret)?;
    let changed = c.execute(
        "UPDATE webhooks SET secret = ?2 WHERE id = ?1",
        &params![id.as_str(), &sealed],
    )?;
    if changed == 0 {
        return Err(not_found(id));
    }
    if let Some(mark) = &request {
        let effect = Effect::SecretRotated {
            webhook_id: id.clone(),
        };
        crate::requests::record_effect(c, mark, &effect)?;
    }
    Ok(())
}

pub(crate) fn seal_webhook_secrets(c: &dyn Db, keyring: &Keyring) -> Result<u64> {
    let current = keyring.current_prefix();
    let mut sealed = 0;
    for mut row in c.query("SELECT id, secret FROM webhooks ORDER BY id", &params![])? {
        let (id, stored) = (row.text(0)?, row.text(1)?);
        if stored.starts_with(&current) {
            continue;
        }
        let secret = keyring
            .open(&id, &stored)
            .map_err(|error| Error::Secrets(format!("webhook {id}'s secret: {error}")))?;
        let resealed = keyring.seal(&id, &secret)?;
        // Fenced by the value read: a secret rotated meanwhile is not overwritten.
        sealed += c.execute(
            "UPDATE webhooks SET secret = ?3 WHERE id = ?1 AND secret = ?2",
            &params![id.as_str(), stored.as_str(), resealed.as_str()],
        )?;
    }
    Ok(sealed)
}

const DELIVERY_COLUMNS: &str = "d.id, d.webhook_id, d.session_id, d.seq, d.event_kind, d.status, \
     d.attempts, w.max_attempts, d.available_at, d.last_status, d.last_error, d.delivered_at, \
     d.created_at, d.updated_at, d.requeued_at";

fn to_delivery(mut r: Row) -> Result<WebhookDelivery> {
    Ok(WebhookDelivery {
        id: r.int(0)?,
        webhook_id: WebhookId::parse(&r.text(1)?).map_err(corrupt)?,
        session_id: parse_session_id(&r.text(2)?)?,
        seq: r.int(3)?,
        event_kind: r.text(4)?,
        status: parse_delivery_status(&r.text(5)?)?,
        attempts: count_of(r.int(6)?)?,
        max_attempts: count_of(r.int(7)?)?,
        available_at: r.opt_int(8)?,
        last_status: r
            .opt_int(9)?
            .map(|code| {
                u16::try_from(code)
                    .map_err(|_| Error::Corrupt(format!("expected an HTTP status, found {code}")))
            })
            .transpose()?,
        last_error: r.opt_text(10)?,
        delivered_at: r.opt_int(11)?,
        created_at: r.int(12)?,
        updated_at: r.int(13)?,
        requeued_at: r.opt_int(14)?,
    })
}

fn parse_delivery_status(text: &str) -> Result<DeliveryStatus> {
    DeliveryStatus::parse(text)
        .ok_or_else(|| Error::Corrupt(format!("expected a delivery status, found {text:?}")))
}

pub(crate) fn deliveries(
    c: &dyn Db,
    webhook_id: &WebhookId,
    status: Option<DeliveryStatus>,
    after: i64,
    limit: u32,
) -> Result<Vec<WebhookDelivery>> {
    get_webhook(c, webhook_id)?;
    let select = format!(
        "SELECT {DELIVERY_COLUMNS} FROM webhook_deliveries d JOIN webhooks w ON w.id = d.webhook_id
         WHERE d.webhook_id = ?1 AND d.id > ?2"
    );
    let rows = match status {
        None => c.query(
            &format!("{select} ORDER BY d.id LIMIT ?3"),
            &params![webhook_id.as_str(), after, limit],
        )?,
        Some(status) => c.query(
            &format!("{select} AND d.status = ?4 ORDER BY d.id LIMIT ?3"),
            &params![webhook_id.as_str(), after, limit, status.as_str()],
        )?,
    };
    rows.into_iter().map(to_delivery).collect()
}

/// Moves a webhook's dead letters (`one` of them, or all) back to pending, due now, their
/// attempts counted afresh; returns how many moved.
fn requeue_dead(c: &dyn Db, webhook_id: &WebhookId, one: Option<i64>, now: Millis) -> Result<u64> {
    DeliveryStatus::DeadLetter
        .edge(DeliveryStatus::Pending)
        .map_err(|e| Error::Conflict(format!("webhook delivery: {e}")))?;
    let requeue = "UPDATE webhook_deliveries
         SET status = 'pending', attempts = 0, available_at = ?2, lease_owner = NULL,
             lease_expires_at = NULL, requeued_at = ?2, updated_at = ?2
         WHERE webhook_id = ?1 AND status = 'dead_letter'";
    match one {
        Some(id) => c.execute(
            &format!("{requeue} AND id = ?3"),
            &params![webhook_id.as_str(), now, id],
        ),
        None => c.execute(requeue, &params![webhook_id.as_str(), now]),
    }
}

pub(crate) fn requeue_delivery(
    c: &dyn Db,
    webhook_id: &WebhookId,
    id: i64,
    now: Millis,
) -> Result<WebhookDelivery> {
    get_webhook(c, webhook_id)?;
    let moved = requeue_dead(c, webhook_id, Some(id), now)?;
    let delivery = c
        .query_opt(
            &format!(
                "SELECT {DELIVERY_COLUMNS} FROM webhook_deliveries d JOIN webhooks w ON w.id = d.webhook_id
                 WHERE d.webhook_id = ?1 AND d.id = ?2"
            ),
            &params![webhook_id.as_str(), id],
        )?
        .map(to_delivery)
        .transpose()?
        .ok_or_else(|| Error::NotFound {
            kind: "webhook delivery",
            id: format!("{id} of webhook {webhook_id}"),
        })?;
    // A repeat of the requeue that moved it finds it on its way again.
    if moved == 1 || delivery.requeued_at.is_some() && delivery.status != DeliveryStatus::DeadLetter
    {
        return Ok(delivery);
    }
    Err(Error::Conflict(format!(
        "delivery {id} is {}: only a dead letter can be requeued",
        delivery.status.as_str()
    )))
}

pub(crate) fn requeue_dead_deliveries(
    c: &dyn Db,
    webhook_id: &WebhookId,
    now: Millis,
) -> Result<u64> {
    get_webhook(c, webhook_id)?;
    requeue_dead(c, webhook_id, None, now)
}

pub(crate) fn bound_deliveries(c: &dyn Db, bounds: DeliveryBounds, now: Millis) -> Result<u64> {
    DeliveryStatus::Pending
        .edge(DeliveryStatus::DeadLetter)
        .map_err(|e| Error::Conflict(format!("webhook delivery: {e}")))?;
    let dead_letter = "UPDATE webhook_deliveries
         SET status = 'dead_letter', available_at = NULL, last_error = ?2, updated_at = ?3
         WHERE status = 'pending' AND";
    let max_age = Millis::try_from(bounds.max_age_ms).unwrap_or(Millis::MAX);
    let expired = format!(
        "expired: not delivered within max_age_ms ({} ms) of being queued",
        bounds.max_age_ms
    );
    let mut dead = c.execute(
        &format!("{dead_letter} created_at <= ?1"),
        &params![now.saturating_sub(max_age), &expired, now],
    )?;
    let crowded = c.query(
        "SELECT webhook_id, session_id, count(*) FROM webhook_deliveries
         WHERE status IN ('pending', 'delivering')
         GROUP BY webhook_id, session_id HAVING count(*) > ?1",
        &params![bounds.max_open_per_session],
    )?;
    let dropped = format!(
        "dropped: the session had more than max_open_per_session ({}) deliveries open",
        bounds.max_open_per_session
    );
    for mut row in crowded {
        let (webhook, session) = (row.text(0)?, row.text(1)?);
        let excess = row.int(2)? - i64::from(bounds.max_open_per_session);
        dead += c.execute(
            &format!(
                "{dead_letter} id IN (SELECT id FROM webhook_deliveries
                     WHERE webhook_id = ?4 AND session_id = ?5 AND status = 'pending'
                     ORDER BY id LIMIT ?1)"
            ),
            &params![excess, &dropped, now, webhook.as_str(), session.as_str()],
        )?;
    }
    Ok(dead)
}

/// Each webhook with each session of its tenant that has events past the webhook's cursor.
const BEHIND: &str = "SELECT w.id, w.events_json, s.id, s.last_seq, COALESCE(k.seq, 0)
     FROM webhooks w
     JOIN sessions s ON s.tenant = w.tenant
     LEFT JOIN webhook_cursors k ON k.webhook_id = w.id AND k.session_id = s.id
     WHERE s.last_seq > COALESCE(k.seq, 0)
     ORDER BY w.id, s.id LIMIT ?1";

/// Whether `queue_deliveries` would find anything: a read, so that a dispatcher with no new
/// events to queue does not take the writer for it.
pub(crate) fn anything_to_queue(c: &dyn Db) -> Result<bool> {
    Ok(!c.query(BEHIND, &params![1u32])?.is_empty())
}

pub(crate) fn queue_deliveries(c: &dyn Db, limit: u32, now: Millis) -> Result<u32> {
    let behind = c.query(BEHIND, &params![limit])?;
    let mut looked_at = 0u32;
    for mut row in behind {
        if looked_at >= limit {
            break;
        }
        let webhook_id = row.text(0)?;
        let wanted: Option<Vec<String>> = row
            .opt_text(1)?
            .map(|text| from_json(&text, "webhook events"))
            .transpose()?;
        let session_id = row.text(2)?;
        let last_seq = row.int(3)?;
        let cursor = row.int(4)?;
        let through = last_seq.min(cursor + i64::from(limit - looked_at));
        let events = c.query(
            "SELECT seq, kind FROM events WHERE session_id = ?1 AND seq > ?2 AND seq <= ?3 ORDER BY seq",
            &params![session_id.as_str(), cursor, through],
        )?;
        for mut event in events {
            let (seq, kind) = (event.int(0)?, event.text(1)?);
            if wanted.as_ref().is_none_or(|kinds| kinds.contains(&kind)) {
                c.execute(
                    "INSERT INTO webhook_deliveries
                     (webhook_id, session_id, seq, event_kind, status, available_at, created_at, updated_at)
                     VALUES (?1, ?2, ?3, ?4, 'pending', ?5, ?5, ?5)
                     ON CONFLICT (webhook_id, session_id, seq) DO NOTHING",
                    &params![webhook_id.as_str(), session_id.as_str(), seq, kind.as_str(), now],
                )?;
            }
        }
        c.execute(
            "INSERT INTO webhook_cursors (webhook_id, session_id, seq) VALUES (?1, ?2, ?3)
             ON CONFLICT (webhook_id, session_id) DO UPDATE SET seq = excluded.seq
             WHERE webhook_cursors.seq < excluded.seq",
            &params![webhook_id.as_str(), session_id.as_str(), through],
        )?;
        looked_at += u32::try_from(through - cursor).unwrap_or(u32::MAX);
    }
    Ok(looked_at)
}

/// Where a delivery was seen: its status and attempt count fence the change.
#[derive(Clone, Copy)]
struct Seen {
    id: i64,
    status: DeliveryStatus,
    attempts: u32,
}

/// Moves a delivery from where it was seen to `to`, setting `set` (whose parameters start at
/// `?6`) and asking the edge table first; false when it was not there any more.
fn move_delivery(
    c: &dyn Db,
    seen: Seen,
    to: DeliveryStatus,
    set: &str,
    values: &[crate::db::Param<'_>],
    now: Millis,
) -> Result<bool> {
    let Seen {
        id,
        status: from,
        attempts,
    } = seen;
    from.edge(to)
        .map_err(|e| Error::Conflict(format!("webhook delivery {id}: {e}")))?;
    let mut all = params![id, from.as_str(), attempts, to.as_str(), now].to_vec();
    all.extend_from_slice(values);
    let changed = c.execute(
        &format!(
            "UPDATE webhook_deliveries SET status = ?4, updated_at = ?5, {set}
             WHERE id = ?1 AND status = ?2 AND attempts = ?3"
        ),
        &all,
    )?;
    Ok(changed == 1)
}

/// The earliest open delivery of each webhook and session, when its attempt is due at `?1`;
/// at most `?2`.
/// The heads come from the open deliveries alone (the partial index holds exactly those): a
/// log of delivered ones, however long, is never read.
fn due_heads() -> String {
    format!(
        "SELECT d.id, d.status, d.attempts, w.id, w.url, w.secret, w.max_attempts, d.session_id, d.seq
         FROM (SELECT webhook_id, session_id, min(seq) AS seq FROM webhook_deliveries
               WHERE status IN {OPEN} GROUP BY webhook_id, session_id) h
         JOIN webhook_deliveries d
           ON d.webhook_id = h.webhook_id AND d.session_id = h.session_id AND d.seq = h.seq
         JOIN webhooks w ON w.id = d.webhook_id
         WHERE (d.status = 'pending' AND d.available_at <= ?1)
            OR (d.status = 'delivering' AND d.lease_expires_at <= ?1)
         ORDER BY d.id LIMIT ?2"
    )
}

pub(crate) fn claim_deliveries(
    c: &dyn Db,
    keyring: &Keyring,
    owner: &str,
    lease_until: Millis,
    limit: u32,
    now: Millis,
) -> Result<Vec<ClaimedDelivery>> {
    let mut claimed = Vec::new();
    // Dead-lettering an expired last attempt makes its session's next delivery the head:
    // look again until nothing more was dead-lettered.
    loop {
        let room = limit.saturating_sub(u32::try_from(claimed.len()).unwrap_or(u32::MAX));
        if room == 0 || !claim_due(c, keyring, owner, lease_until, room, now, &mut claimed)? {
            return Ok(claimed);
        }
    }
}

/// Claims up to `limit` due heads into `claimed`; true when it dead-lettered any.
fn claim_due(
    c: &dyn Db,
    keyring: &Keyring,
    owner: &str,
    lease_until: Millis,
    limit: u32,
    now: Millis,
    claimed: &mut Vec<ClaimedDelivery>,
) -> Result<bool> {
    let mut dead_lettered = false;
    let due = c.query(&due_heads(), &params![now, limit])?;
    for mut row in due {
        let seen = Seen {
            id: row.int(0)?,
            status: parse_delivery_status(&row.text(1)?)?,
            attempts: count_of(row.int(2)?)?,
        };
        let (id, attempts) = (seen.id, seen.attempts);
        let webhook_id = WebhookId::parse(&row.text(3)?).map_err(corrupt)?;
        let url = row.text(4)?;
        // Opened before anything moves: a secret this process cannot open fails the claim
        // whole, and another process with the key makes the attempt.
        let secret = keyring
            .open(webhook_id.as_str(), &row.text(5)?)
            .map_err(|error| Error::Secrets(format!("webhook {webhook_id}'s secret: {error}")))?;
        let max_attempts = count_of(row.int(6)?)?;
        let (session_id, seq) = (row.text(7)?, row.int(8)?);
        if attempts >= max_attempts {
            // Its last attempt's dispatcher stopped before saying how the attempt ended.
            move_delivery(
                c,
                seen,
                DeliveryStatus::DeadLetter,
                "lease_owner = NULL, lease_expires_at = NULL, available_at = NULL, last_error = ?6",
                &params!["the last attempt's outcome is unknown: its dispatcher stopped"],
                now,
            )?;
            dead_lettered = true;
            continue;
        }
        let taken = move_delivery(
            c,
            seen,
            DeliveryStatus::Delivering,
            "attempts = attempts + 1, lease_owner = ?6, lease_expires_at = ?7, available_at = NULL",
            &params![owner, lease_until],
            now,
        )?;
        if !taken {
            continue;
        }
        let event = c
            .query_opt(
                &format!("SELECT {EVENT_COLUMNS} FROM events WHERE session_id = ?1 AND seq = ?2"),
                &params![session_id.as_str(), seq],
            )?
            .map(to_event)
            .transpose()?
            .ok_or_else(|| {
                Error::Corrupt(format!(
                    "webhook delivery {id} names event {session_id}#{seq}, which does not exist"
                ))
            })?;
        let traceparent = match &event.run_id {
            Some(run) => Some(crate::runs::run_traceparent(c, run)?),
            None => None,
        };
        claimed.push(ClaimedDelivery {
            claim: DeliveryClaim {
                delivery_id: id,
                attempt: attempts + 1,
            },
            webhook_id,
            url,
            secret,
            max_attempts,
            event,
            traceparent,
        });
    }
    Ok(dead_lettered)
}

pub(crate) fn finish_delivery(
    c: &dyn Db,
    claim: &DeliveryClaim,
    outcome: AttemptOutcome,
    now: Millis,
) -> Result<bool> {
    // Every claim of a delivery counts an attempt, so its status and attempt count are the
    // fence: a taken-over or dead-lettered attempt no longer matches and nothing is written.
    let seen = Seen {
        id: claim.delivery_id,
        status: DeliveryStatus::Delivering,
        attempts: claim.attempt,
    };
    let cleared = "lease_owner = NULL, lease_expires_at = NULL";
    match outcome {
        AttemptOutcome::Delivered { status } => move_delivery(
            c,
            seen,
            DeliveryStatus::Delivered,
            &format!("{cleared}, last_status = ?6, last_error = NULL, delivered_at = ?5"),
            &params![i64::from(status)],
            now,
        ),
        AttemptOutcome::Failed {
            status,
            error,
            retry_at,
        } => {
            let to = if retry_at.is_some() {
                DeliveryStatus::Pending
            } else {
                DeliveryStatus::DeadLetter
            };
            move_delivery(
                c,
                seen,
                to,
                &format!("{cleared}, last_status = ?6, last_error = ?7, available_at = ?8"),
                &params![status.map(i64::from), error.as_str(), retry_at],
                now,
            )
        }
    }
}
