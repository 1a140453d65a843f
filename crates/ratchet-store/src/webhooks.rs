//! The observation plane's port: webhooks, their deliveries, and the events they carry.
//!
//! Two roles, each deliberately narrow: `WebhookAdmin` for the API an operator uses, and
//! `Deliveries` for the webhook dispatcher, which with `Reads` can read events and keep its
//! own delivery records, and has no method that could enqueue a job or change a session or a
//! run.
//!
//! Signing secrets are stored sealed (`secrets`): a store opened with a `Keyring` seals them
//! as webhooks are created or given a new secret, and opens them only to hand an attempt
//! (`ClaimedDelivery`) to a dispatcher. Nothing else reads them back.

use async_trait::async_trait;
use ratchet_core::{DeliveryStatus, Millis, SessionId, WebhookId};
use serde::Serialize;

use crate::{Result, StoredEvent};

/// What a webhook is created with.
#[derive(Debug, Clone, PartialEq)]
pub struct NewWebhook {
    pub id: WebhookId,
    pub tenant: String,
    pub url: String,
    /// The event kinds it receives; None for every kind.
    pub events: Option<Vec<String>>,
    /// The key its deliveries are signed with (the store keeps it sealed).
    pub secret: String,
    /// Attempts of one delivery before it is dead-lettered.
    pub max_attempts: u32,
    /// The keyed request creating it: `Effect::WebhookCreated` is recorded with the key in
    /// the webhook's transaction (`Error::Conflict`, nothing created, if the key was lost).
    pub request: Option<crate::RequestMark>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Webhook {
    pub id: WebhookId,
    pub tenant: String,
    pub url: String,
    pub events: Option<Vec<String>>,
    pub max_attempts: u32,
    pub created_at: Millis,
}

impl Webhook {
    pub fn wants(&self, kind: &str) -> bool {
        self.events
            .as_ref()
            .is_none_or(|kinds| kinds.iter().any(|k| k == kind))
    }
}

/// One event's delivery to one webhook, as the delivery log lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WebhookDelivery {
    pub id: i64,
    pub webhook_id: WebhookId,
    pub session_id: SessionId,
    pub seq: i64,
    pub event_kind: String,
    pub status: DeliveryStatus,
    /// Attempts made so far (an attempt in flight included).
    pub attempts: u32,
    pub max_attempts: u32,
    /// When a pending delivery's next attempt is due.
    pub available_at: Option<Millis>,
    /// The HTTP status of the last answered attempt.
    pub last_status: Option<u16>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    pub delivered_at: Option<Millis>,
    /// When an operator last requeued it from the dead letter.
    pub requeued_at: Option<Millis>,
    pub created_at: Millis,
    pub updated_at: Millis,
}

/// How many open deliveries a webhook's log may hold, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeliveryBounds {
    pub max_age_ms: u64,
    pub max_open_per_session: u32,
}

/// Proof that a dispatcher holds an attempt: finishing it is refused once the attempt was
/// taken over (every claim counts an attempt, so the attempt number is the fence).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryClaim {
    pub delivery_id: i64,
    pub attempt: u32,
}

/// An attempt handed to a dispatcher: what to send, where, and signed with what.
#[derive(Debug, Clone)]
pub struct ClaimedDelivery {
    pub claim: DeliveryClaim,
    pub webhook_id: WebhookId,
    pub url: String,
    /// The signing secret, opened for this attempt.
    pub secret: String,
    pub max_attempts: u32,
    pub event: StoredEvent,
    /// The W3C `traceparent` of the event's run (`ratchet_core::trace::run_traceparent`),
    /// for an event of a run.
    pub traceparent: Option<String>,
}

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptOutcome {
    /// A 2xx answer.
    Delivered { status: u16 },
    /// Any other answer, or none: the status when there was one.
    Failed {
        status: Option<u16>,
        error: String,
        /// When a pending delivery is tried again; None dead-letters it.
        retry_at: Option<Millis>,
    },
}

/// The administration of webhooks: what an operator creates, reads, rotates and requeues.
#[async_trait]
pub trait WebhookAdmin: Send + Sync + 'static {
    /// Creates a webhook. It receives the events written from now on: the tenant's existing
    /// sessions are followed from their latest event, new ones from their first.
    async fn create_webhook(&self, webhook: NewWebhook, now: Millis) -> Result<Webhook>;

    async fn get_webhook(&self, id: &WebhookId) -> Result<Webhook>;

    /// A tenant's webhooks in creation order.
    async fn webhooks(&self, tenant: &str) -> Result<Vec<Webhook>>;

    /// Removes a webhook with its deliveries: nothing more is sent to it.
    async fn delete_webhook(&self, id: &WebhookId) -> Result<()>;

    /// Replaces a webhook's signing secret: the attempts claimed from now on are signed with
    /// it. `request`'s key records `Effect::SecretRotated` in the same transaction.
    async fn rotate_webhook_secret(
        &self,
        id: &WebhookId,
        secret: String,
        request: Option<crate::RequestMark>,
    ) -> Result<()>;

    /// Seals under the keyring's current key every secret that is not sealed with it yet: those
    /// written in clear before secrets were sealed, and those a previous key sealed. Returns how
    /// many it sealed; fails, sealing nothing, when a secret does not open with this store's
    /// keys.
    async fn seal_webhook_secrets(&self) -> Result<u64>;

    /// A webhook's deliveries in the order they were queued, after `after` (a delivery id),
    /// with the given status only when given.
    async fn deliveries(
        &self,
        webhook_id: &WebhookId,
        status: Option<DeliveryStatus>,
        after: i64,
        limit: u32,
    ) -> Result<Vec<WebhookDelivery>>;

    /// An operator puts a dead-lettered delivery back to `pending`: due now, its attempts
    /// counted afresh. A repeat of that requeue (the delivery was requeued and is no dead
    /// letter since) changes nothing. Refused with `Error::Conflict` for any other delivery,
    /// `Error::NotFound` for one the webhook does not have.
    async fn requeue_delivery(
        &self,
        webhook_id: &WebhookId,
        delivery_id: i64,
        now: Millis,
    ) -> Result<WebhookDelivery>;

    /// `requeue_delivery` for every dead letter of a webhook; returns how many it requeued.
    async fn requeue_dead_deliveries(&self, webhook_id: &WebhookId, now: Millis) -> Result<u64>;
}

/// The delivery log's work: what the webhook dispatcher bounds, queues, claims and finishes.
#[async_trait]
pub trait Deliveries: Send + Sync + 'static {
    /// Keeps the open deliveries within `bounds`, so that a receiver down for long does not
    /// grow the log without end: a pending delivery queued more than `max_age_ms` ago is
    /// dead-lettered (`expired`), and so are the oldest pending deliveries of a webhook and
    /// session with more than `max_open_per_session` open ones. Returns how many it
    /// dead-lettered; they stay in the log, saying why.
    async fn bound_deliveries(&self, bounds: DeliveryBounds, now: Millis) -> Result<u64>;

    /// Queues a pending delivery for each event a webhook wants that was written since it
    /// last looked, at most about `limit` events in one transaction; returns how many events
    /// it looked at (0 when it is caught up). Queuing the same event twice keeps one delivery.
    async fn queue_deliveries(&self, limit: u32, now: Millis) -> Result<u32>;

    /// Claims up to `limit` due attempts for `owner` until `lease_until`: for each webhook
    /// and session only the earliest open delivery, so a session's events go out in `seq`
    /// order. A delivery whose lease expired is claimed again, counting another attempt.
    async fn claim_deliveries(
        &self,
        owner: &str,
        lease_until: Millis,
        limit: u32,
        now: Millis,
    ) -> Result<Vec<ClaimedDelivery>>;

    /// Records how claimed attempts ended, in one transaction; for each, false (nothing
    /// written for it) when its claim was lost.
    async fn finish_deliveries(
        &self,
        finished: Vec<(DeliveryClaim, AttemptOutcome)>,
        now: Millis,
    ) -> Result<Vec<bool>>;
}
