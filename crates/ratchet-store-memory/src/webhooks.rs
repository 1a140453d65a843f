//! The observation plane: webhooks, the cursors that follow each session's events for each
//! webhook, and the deliveries queued from them. Every delivery status change asks
//! `DeliveryStatus::edge` first; a signing secret is kept sealed and opened only to hand a
//! claimed attempt its key.

use ratchet_core::{DeliveryStatus, Millis, SessionId, WebhookId};
use ratchet_store::{
    AttemptOutcome, ClaimedDelivery, DeliveryBounds, DeliveryClaim, Error, Keyring, NewWebhook,
    Result, Webhook, WebhookDelivery,
};

use crate::tables::{DeliveryRow, Tables, WebhookRow};

impl Tables {
    pub(crate) fn create_webhook(
        &mut self,
        keyring: &Keyring,
        new: NewWebhook,
        now: Millis,
    ) -> Result<Webhook> {
        let secret = keyring.seal(new.id.as_str(), &new.secret)?;
        if self.webhooks.contains_key(&new.id) {
            return Err(Error::Conflict(format!(
                "webhook {} already exists",
                new.id
            )));
        }
        // What was written before the webhook existed is not sent to it.
        for (session_id, session) in &self.sessions {
            if session.tenant == new.tenant && session.last_seq() > 0 {
                (self.cursors).insert((new.id.clone(), session_id.clone()), session.last_seq());
            }
        }
        self.webhooks.insert(
            new.id.clone(),
            WebhookRow {
                tenant: new.tenant,
                url: new.url,
                events: new.events,
                secret,
                max_attempts: new.max_attempts,
                created_at: now,
            },
        );
        self.get_webhook(&new.id)
    }

    fn webhook(&self, id: &WebhookId) -> Result<&WebhookRow> {
        self.webhooks.get(id).ok_or_else(|| not_found(id))
    }

    pub(crate) fn get_webhook(&self, id: &WebhookId) -> Result<Webhook> {
        Ok(webhook_view(id, self.webhook(id)?))
    }

    /// A tenant's webhooks in creation order.
    pub(crate) fn webhooks(&self, tenant: &str) -> Vec<Webhook> {
        let mut found: Vec<Webhook> = (self.webhooks.iter())
            .filter(|(_, w)| w.tenant == tenant)
            .map(|(id, w)| webhook_view(id, w))
            .collect();
        found.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        found
    }

    pub(crate) fn delete_webhook(&mut self, id: &WebhookId) -> Result<()> {
        self.webhooks.remove(id).ok_or_else(|| not_found(id))?;
        self.deliveries.retain(|_, d| d.webhook_id != *id);
        self.cursors.retain(|(webhook, _), _| webhook != id);
        Ok(())
    }

    pub(crate) fn rotate_webhook_secret(
        &mut self,
        keyring: &Keyring,
        id: &WebhookId,
        secret: &str,
    ) -> Result<()> {
        let sealed = keyring.seal(id.as_str(), secret)?;
        let webhook = self.webhooks.get_mut(id).ok_or_else(|| not_found(id))?;
        webhook.secret = sealed;
        Ok(())
    }

    pub(crate) fn seal_webhook_secrets(&mut self, keyring: &Keyring) -> Result<u64> {
        let current = keyring.current_prefix();
        let mut sealed = 0;
        for (id, webhook) in &mut self.webhooks {
            if webhook.secret.starts_with(&current) {
                continue;
            }
            let secret = keyring
                .open(id.as_str(), &webhook.secret)
                .map_err(|error| Error::Secrets(format!("webhook {id}'s secret: {error}")))?;
            webhook.secret = keyring.seal(id.as_str(), &secret)?;
            sealed += 1;
        }
        Ok(sealed)
    }

    pub(crate) fn deliveries(
        &self,
        webhook_id: &WebhookId,
        status: Option<DeliveryStatus>,
        after: i64,
        limit: u32,
    ) -> Result<Vec<WebhookDelivery>> {
        let webhook = self.webhook(webhook_id)?;
        Ok((self.deliveries.range(after.saturating_add(1)..))
            .filter(|(_, d)| d.webhook_id == *webhook_id && status.is_none_or(|s| d.status == s))
            .take(limit as usize)
            .map(|(id, d)| delivery_view(*id, d, webhook))
            .collect())
    }

    /// Moves a webhook's dead letters (`one` of them, or all) back to pending, due now, their
    /// attempts counted afresh; returns how many moved.
    fn requeue_dead(
        &mut self,
        webhook_id: &WebhookId,
        one: Option<i64>,
        now: Millis,
    ) -> Result<u64> {
        DeliveryStatus::DeadLetter
            .edge(DeliveryStatus::Pending)
            .map_err(|e| Error::Conflict(format!("webhook delivery: {e}")))?;
        let mut moved = 0;
        for (id, delivery) in &mut self.deliveries {
            if delivery.webhook_id == *webhook_id
                && delivery.status == DeliveryStatus::DeadLetter
                && one.is_none_or(|one| one == *id)
            {
                delivery.status = DeliveryStatus::Pending;
                delivery.attempts = 0;
                delivery.available_at = Some(now);
                delivery.lease_owner = None;
                delivery.lease_expires_at = None;
                delivery.requeued_at = Some(now);
                delivery.updated_at = now;
                moved += 1;
            }
        }
        Ok(moved)
    }

    pub(crate) fn requeue_delivery(
        &mut self,
        webhook_id: &WebhookId,
        id: i64,
        now: Millis,
    ) -> Result<WebhookDelivery> {
        self.webhook(webhook_id)?;
        let moved = self.requeue_dead(webhook_id, Some(id), now)?;
        let webhook = self.webhook(webhook_id)?;
        let delivery = (self.deliveries.get(&id))
            .filter(|d| d.webhook_id == *webhook_id)
            .map(|d| delivery_view(id, d, webhook))
            .ok_or_else(|| Error::NotFound {
                kind: "webhook delivery",
                id: format!("{id} of webhook {webhook_id}"),
            })?;
        // A repeat of the requeue that moved it finds it on its way again.
        if moved == 1
            || delivery.requeued_at.is_some() && delivery.status != DeliveryStatus::DeadLetter
        {
            return Ok(delivery);
        }
        Err(Error::Conflict(format!(
            "delivery {id} is {}: only a dead letter can be requeued",
            delivery.status.as_str()
        )))
    }

    pub(crate) fn requeue_dead_deliveries(
        &mut self,
        webhook_id: &WebhookId,
        now: Millis,
    ) -> Result<u64> {
        self.webhook(webhook_id)?;
        self.requeue_dead(webhook_id, None, now)
    }

    pub(crate) fn bound_deliveries(&mut self, bounds: DeliveryBounds, now: Millis) -> Result<u64> {
        DeliveryStatus::Pending
            .edge(DeliveryStatus::DeadLetter)
            .map_err(|e| Error::Conflict(format!("webhook delivery: {e}")))?;
        let max_age = Millis::try_from(bounds.max_age_ms).unwrap_or(Millis::MAX);
        let expired = format!(
            "expired: not delivered within max_age_ms ({} ms) of being queued",
            bounds.max_age_ms
        );
        let oldest_kept = now.saturating_sub(max_age);
        let mut dead = 0;
        for delivery in self.deliveries.values_mut() {
            if delivery.status == DeliveryStatus::Pending && delivery.created_at <= oldest_kept {
                dead_letter(delivery, &expired, now);
                dead += 1;
            }
        }
        let dropped = format!(
            "dropped: the session had more than max_open_per_session ({}) deliveries open",
            bounds.max_open_per_session
        );
        let mut open: std::collections::BTreeMap<(WebhookId, SessionId), usize> =
            std::collections::BTreeMap::new();
        for delivery in self.deliveries.values().filter(|d| d.status.is_open()) {
            *open
                .entry((delivery.webhook_id.clone(), delivery.session_id.clone()))
                .or_default() += 1;
        }
        let allowed = bounds.max_open_per_session as usize;
        for ((webhook, session), open) in open {
            // The oldest pending deliveries go first; one in flight is left to finish.
            let mut excess = open.saturating_sub(allowed);
            for delivery in self.deliveries.values_mut() {
                if excess == 0 {
                    break;
                }
                if delivery.webhook_id == webhook
                    && delivery.session_id == session
                    && delivery.status == DeliveryStatus::Pending
                {
                    dead_letter(delivery, &dropped, now);
                    dead += 1;
                    excess -= 1;
                }
            }
        }
        Ok(dead)
    }

    /// Each webhook with each session of its tenant that has events past the webhook's
    /// cursor: the webhook, the session, the session's last seq and the cursor.
    fn behind(&self) -> Vec<(WebhookId, SessionId, i64, i64)> {
        let mut behind = Vec::new();
        for (webhook_id, webhook) in &self.webhooks {
            for (session_id, session) in &self.sessions {
                let last_seq = session.last_seq();
                let cursor = (self.cursors.get(&(webhook_id.clone(), session_id.clone())))
                    .copied()
                    .unwrap_or(0);
                if session.tenant == webhook.tenant && last_seq > cursor {
                    behind.push((webhook_id.clone(), session_id.clone(), last_seq, cursor));
                }
            }
        }
        behind
    }

    pub(crate) fn queue_deliveries(&mut self, limit: u32, now: Millis) -> Result<u32> {
        let mut looked_at = 0u32;
        for (webhook_id, session_id, last_seq, cursor) in
            self.behind().into_iter().take(limit as usize)
        {
            if looked_at >= limit {
                break;
            }
            let through = last_seq.min(cursor + i64::from(limit - looked_at));
            let wanted = self.webhook(&webhook_id)?.events.clone();
            let events: Vec<(i64, String)> = (self.events_after(&session_id, cursor, u32::MAX))
                .into_iter()
                .take_while(|e| e.seq <= through)
                .map(|e| (e.seq, e.kind))
                .collect();
            for (seq, kind) in events {
                let queued = self.deliveries.values().any(|d| {
                    d.webhook_id == webhook_id && d.session_id == session_id && d.seq == seq
                });
                if queued || wanted.as_ref().is_some_and(|kinds| !kinds.contains(&kind)) {
                    continue;
                }
                self.last_delivery_id += 1;
                self.deliveries.insert(
                    self.last_delivery_id,
                    DeliveryRow {
                        webhook_id: webhook_id.clone(),
                        session_id: session_id.clone(),
                        seq,
                        event_kind: kind,
                        status: DeliveryStatus::Pending,
                        attempts: 0,
                        available_at: Some(now),
                        lease_owner: None,
                        lease_expires_at: None,
                        last_status: None,
                        last_error: None,
                        delivered_at: None,
                        requeued_at: None,
                        created_at: now,
                        updated_at: now,
                    },
                );
            }
            let kept = self.cursors.entry((webhook_id, session_id)).or_insert(0);
            *kept = (*kept).max(through);
            looked_at += u32::try_from(through - cursor).unwrap_or(u32::MAX);
        }
        Ok(looked_at)
    }

    /// Claims up to `limit` due attempts: for each webhook and session only the earliest open
    /// delivery. Dead-lettering an expired last attempt makes its session's next delivery the
    /// head, so the heads are looked at again until none was dead-lettered.
    pub(crate) fn claim_deliveries(
        &mut self,
        keyring: &Keyring,
        owner: &str,
        lease_until: Millis,
        limit: u32,
        now: Millis,
    ) -> Result<Vec<ClaimedDelivery>> {
        let mut claimed = Vec::new();
        loop {
            let room = (limit as usize).saturating_sub(claimed.len());
            if room == 0 {
                return Ok(claimed);
            }
            let mut dead_lettered = false;
            for id in self.due_heads(room, now) {
                let Some(delivery) = self.deliveries.get(&id) else {
                    continue;
                };
                let webhook_id = delivery.webhook_id.clone();
                let webhook = self.webhook(&webhook_id)?;
                // Opened before anything moves: a secret this process cannot open fails the
                // claim whole.
                let secret =
                    keyring
                        .open(webhook_id.as_str(), &webhook.secret)
                        .map_err(|error| {
                            Error::Secrets(format!("webhook {webhook_id}'s secret: {error}"))
                        })?;
                let (url, max_attempts) = (webhook.url.clone(), webhook.max_attempts);
                let (session_id, seq, attempts) =
                    (delivery.session_id.clone(), delivery.seq, delivery.attempts);
                let from = delivery.status;
                let Some(delivery) = self.deliveries.get_mut(&id) else {
                    continue;
                };
                if attempts >= max_attempts {
                    // Its last attempt's dispatcher stopped before saying how the attempt ended.
                    edge(id, from, DeliveryStatus::DeadLetter)?;
                    delivery.status = DeliveryStatus::DeadLetter;
                    delivery.updated_at = now;
                    delivery.lease_owner = None;
                    delivery.lease_expires_at = None;
                    delivery.available_at = None;
                    delivery.last_error = Some(
                        "the last attempt's outcome is unknown: its dispatcher stopped".into(),
                    );
                    dead_lettered = true;
                    continue;
                }
                edge(id, from, DeliveryStatus::Delivering)?;
                delivery.status = DeliveryStatus::Delivering;
                delivery.updated_at = now;
                delivery.attempts += 1;
                delivery.lease_owner = Some(owner.to_owned());
                delivery.lease_expires_at = Some(lease_until);
                delivery.available_at = None;
                let event = self.event(&session_id, seq).cloned().ok_or_else(|| {
                    Error::Corrupt(format!(
                        "webhook delivery {id} names event {session_id}#{seq}, which does not exist"
                    ))
                })?;
                claimed.push(ClaimedDelivery {
                    claim: DeliveryClaim {
                        delivery_id: id,
                        attempt: attempts + 1,
                    },
                    webhook_id,
                    url,
                    secret,
                    max_attempts,
                    traceparent: event.run_id.as_ref().map(|run| {
                        let stored = self.runs.get(run).and_then(|r| r.state.trace);
                        ratchet_core::trace::run_traceparent(run, stored.as_ref())
                    }),
                    event,
                });
            }
            if !dead_lettered {
                return Ok(claimed);
            }
        }
    }

    /// The earliest open delivery of each webhook and session, when its attempt is due by
    /// `now`; at most `limit`, in the order they were queued.
    fn due_heads(&self, limit: usize, now: Millis) -> Vec<i64> {
        let mut heads: std::collections::BTreeMap<(&WebhookId, &SessionId), (i64, i64)> =
            std::collections::BTreeMap::new();
        for (id, d) in self.deliveries.iter().filter(|(_, d)| d.status.is_open()) {
            let head = heads
                .entry((&d.webhook_id, &d.session_id))
                .or_insert((d.seq, *id));
            if d.seq < head.0 {
                *head = (d.seq, *id);
            }
        }
        let mut due: Vec<i64> = (heads.into_values())
            .map(|(_, id)| id)
            .filter(|id| {
                self.deliveries.get(id).is_some_and(|d| {
                    let due = match d.status {
                        DeliveryStatus::Pending => d.available_at.is_some_and(|at| at <= now),
                        DeliveryStatus::Delivering => {
                            d.lease_expires_at.is_some_and(|at| at <= now)
                        }
                        DeliveryStatus::Delivered | DeliveryStatus::DeadLetter => false,
                    };
                    due && self.webhooks.contains_key(&d.webhook_id)
                })
            })
            .collect();
        due.sort();
        due.truncate(limit);
        due
    }

    /// Records how a claimed attempt ended; false (nothing written) when its claim was lost.
    /// Every claim counts an attempt, so its status and attempt count are the fence.
    pub(crate) fn finish_delivery(
        &mut self,
        claim: &DeliveryClaim,
        outcome: AttemptOutcome,
        now: Millis,
    ) -> Result<bool> {
        let id = claim.delivery_id;
        let to = match &outcome {
            AttemptOutcome::Delivered { .. } => DeliveryStatus::Delivered,
            AttemptOutcome::Failed {
                retry_at: Some(_), ..
            } => DeliveryStatus::Pending,
            AttemptOutcome::Failed { retry_at: None, .. } => DeliveryStatus::DeadLetter,
        };
        edge(id, DeliveryStatus::Delivering, to)?;
        let Some(delivery) = (self.deliveries.get_mut(&id))
            .filter(|d| d.status == DeliveryStatus::Delivering && d.attempts == claim.attempt)
        else {
            return Ok(false);
        };
        delivery.status = to;
        delivery.updated_at = now;
        delivery.lease_owner = None;
        delivery.lease_expires_at = None;
        match outcome {
            AttemptOutcome::Delivered { status } => {
                delivery.last_status = Some(status);
                delivery.last_error = None;
                delivery.delivered_at = Some(now);
            }
            AttemptOutcome::Failed {
                status,
                error,
                retry_at,
            } => {
                delivery.last_status = status;
                delivery.last_error = Some(error);
                delivery.available_at = retry_at;
            }
        }
        Ok(true)
    }
}

fn not_found(id: &WebhookId) -> Error {
    Error::NotFound {
        kind: "webhook",
        id: id.to_string(),
    }
}

fn edge(id: i64, from: DeliveryStatus, to: DeliveryStatus) -> Result<()> {
    from.edge(to)
        .map_err(|e| Error::Conflict(format!("webhook delivery {id}: {e}")))
}

fn dead_letter(delivery: &mut DeliveryRow, why: &str, now: Millis) {
    delivery.status = DeliveryStatus::DeadLetter;
    delivery.available_at = None;
    delivery.last_error = Some(why.to_owned());
    delivery.updated_at = now;
}

fn webhook_view(id: &WebhookId, w: &WebhookRow) -> Webhook {
    Webhook {
        id: id.clone(),
        tenant: w.tenant.clone(),
        url: w.url.clone(),
        events: w.events.clone(),
        max_attempts: w.max_attempts,
        created_at: w.created_at,
    }
}

fn delivery_view(id: i64, d: &DeliveryRow, webhook: &WebhookRow) -> WebhookDelivery {
    WebhookDelivery {
        id,
        webhook_id: d.webhook_id.clone(),
        session_id: d.session_id.clone(),
        seq: d.seq,
        event_kind: d.event_kind.clone(),
        status: d.status,
        attempts: d.attempts,
        max_attempts: webhook.max_attempts,
        available_at: d.available_at,
        last_status: d.last_status,
        last_error: d.last_error.clone(),
        delivered_at: d.delivered_at,
        requeued_at: d.requeued_at,
        created_at: d.created_at,
        updated_at: d.updated_at,
    }
}
