//! The webhook dispatcher: an observation-plane plugin that sends each event a tenant's
//! webhooks want as a signed POST, in `seq` order per session, retrying failed attempts with
//! backoff until a delivery is dead-lettered.
//!
//! It holds the `Deliveries` role only, not the state plane's: it can read events and keep its
//! own delivery records, and nothing it does can enqueue a job or change a run. It runs as
//! one task beside the workers, each attempt a task of its own under a timeout, so a slow or
//! failing receiver delays its own deliveries and nothing else.
//!
//! It connects only where its `WebhookPolicy` allows (`policy`): an address in the URL is
//! checked before the request, a name's addresses as they resolve, and no proxy is used. What
//! a tenant reads in the delivery log is an HTTP status, a refusal by the policy, or that no
//! HTTP answer came; never how a connection failed, which would map ports for them.

mod policy;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, KeyInit, Mac};
use ratchet_core::Millis;
use ratchet_core::webhook::{AfterFailure, Backoff, after_failure};
use ratchet_store::{AttemptOutcome, ClaimedDelivery, Deliveries, DeliveryBounds, DeliveryClaim};
use serde_json::json;
use sha2::Sha256;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use url::Url;

pub use policy::{BadRule, InternalName, Range, Refusal, Rule, WebhookPolicy};

/// The delivery log's error when an attempt got no HTTP answer. One message for every way that
/// happens (refused, reset, timed out, not HTTP, a TLS failure), so the log does not tell a
/// closed port from an open one; the dispatcher's own log has the details.
pub const NO_ANSWER: &str =
    "no HTTP answer from the receiver (unreachable, too slow, or not speaking HTTP)";

/// The header carrying `t=<milliseconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">`.
pub const SIGNATURE_HEADER: &str = "ratchet-signature";
/// The delivery's id: the same on every attempt, so a receiver can drop a repeat.
pub const DELIVERY_HEADER: &str = "ratchet-delivery";
pub const EVENT_HEADER: &str = "ratchet-event";

#[derive(Debug, Clone)]
pub struct DispatcherConfig {
    /// Names this dispatcher's claims (a process may die holding some).
    pub owner: String,
    /// How often it looks for new events and due attempts when nothing else wakes it.
    pub poll: Duration,
    /// How long an attempt may take before it counts as failed.
    pub timeout: Duration,
    /// Attempts in flight at once, over every webhook.
    pub concurrency: u32,
    /// Events looked at per queuing transaction.
    pub batch: u32,
    pub backoff: Backoff,
    /// Where attempts may connect.
    pub policy: WebhookPolicy,
    /// How many open deliveries the log may hold, and for how long.
    pub bounds: DeliveryBounds,
}

/// How often the dispatcher keeps the open deliveries within their bounds.
const BOUND_EVERY: Duration = Duration::from_secs(10);

impl Default for DispatcherConfig {
    fn default() -> Self {
        DispatcherConfig {
            owner: format!("webhooks-{}", std::process::id()),
            poll: Duration::from_millis(250),
            timeout: Duration::from_secs(10),
            concurrency: 16,
            batch: 2000,
            backoff: Backoff::default(),
            policy: WebhookPolicy::default(),
            bounds: DeliveryBounds {
                max_age_ms: 7 * 24 * 3_600_000,
                max_open_per_session: 10_000,
            },
        }
    }
}

/// Starts the dispatcher; it stops when `shutdown` is cancelled. Attempts still in flight
/// then are abandoned: their leases expire and they are made again (delivery is at least
/// once; receivers drop repeats by the delivery id).
/// `Err` when no HTTP client can be built (no TLS backend).
pub fn spawn(
    hooks: Arc<dyn Deliveries>,
    config: DispatcherConfig,
    shutdown: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, reqwest::Error> {
    let dispatcher = Dispatcher::new(hooks, config)?;
    Ok(tokio::spawn(dispatcher.run(shutdown)))
}

struct Dispatcher {
    hooks: Arc<dyn Deliveries>,
    config: DispatcherConfig,
    http: reqwest::Client,
}

/// An attempt's result as the task that made it reports it back.
struct Attempt {
    claim: DeliveryClaim,
    max_attempts: u32,
    answer: Answer,
}

enum Answer {
    Status(u16),
    /// The policy refused the destination; nothing was sent.
    Refused(Refusal),
    /// No HTTP answer (see `NO_ANSWER`).
    None,
}

impl Dispatcher {
    fn new(
        hooks: Arc<dyn Deliveries>,
        config: DispatcherConfig,
    ) -> Result<Dispatcher, reqwest::Error> {
        let http = reqwest::Client::builder()
            .timeout(config.timeout)
            // A redirect is an answer like any other non-2xx: the receiver's URL is the one
            // configured, and a signed body is not forwarded elsewhere.
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("ratchet/", env!("CARGO_PKG_VERSION")))
            // A proxy would resolve and connect in the resolver's place, past the policy.
            .no_proxy()
            .dns_resolver(Arc::new(Resolver {
                policy: config.policy.clone(),
            }))
            .build()?;
        Ok(Dispatcher {
            hooks,
            config,
            http,
        })
    }

    async fn run(self, shutdown: CancellationToken) {
        let mut in_flight: JoinSet<Attempt> = JoinSet::new();
        let mut queued_at: Option<Instant> = None;
        let mut caught_up = true;
        let mut bounded_at: Option<Instant> = None;
        loop {
            if bounded_at.is_none_or(|at| at.elapsed() >= BOUND_EVERY) {
                self.bound().await;
                bounded_at = Some(Instant::now());
            }
            // New events are looked for every `poll`, or at once while a backlog remains;
            // attempts are claimed whenever one has ended, to keep sessions moving.
            if !caught_up || queued_at.is_none_or(|at| at.elapsed() >= self.config.poll) {
                caught_up = self.queue().await;
                queued_at = Some(Instant::now());
            }
            let room = self
                .config
                .concurrency
                .saturating_sub(u32::try_from(in_flight.len()).unwrap_or(u32::MAX));
            if room > 0 {
                for delivery in self.claim(room).await {
                    in_flight.spawn(attempt(
                        self.http.clone(),
                        self.config.policy.clone(),
                        delivery,
                    ));
                }
            }
            let wait = if caught_up {
                self.config.poll
            } else {
                Duration::ZERO
            };
            tokio::select! {
                () = shutdown.cancelled() => return,
                Some(done) = in_flight.join_next(), if !in_flight.is_empty() => {
                    // Every other attempt that has ended too, recorded together.
                    let mut ended = vec![done];
                    while let Some(done) = in_flight.try_join_next() {
                        ended.push(done);
                    }
                    self.record(ended).await;
                }
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Queues one batch (short transactions; a backlog is worked off turn by turn); true
    /// when nothing more is waiting to be queued.
    async fn queue(&self) -> bool {
        match self
            .hooks
            .queue_deliveries(self.config.batch, now_ms())
            .await
        {
            Ok(looked_at) => looked_at < self.config.batch,
            Err(error) => {
                tracing::warn!(%error, "cannot queue webhook deliveries");
                true
            }
        }
    }

    async fn bound(&self) {
        match self
            .hooks
            .bound_deliveries(self.config.bounds, now_ms())
            .await
        {
            Ok(0) => {}
            Ok(dead) => tracing::warn!(
                dead,
                "webhook deliveries dead-lettered: too old or too many open"
            ),
            Err(error) => {
                tracing::warn!(%error, "cannot keep webhook deliveries within their bounds")
            }
        }
    }

    async fn claim(&self, room: u32) -> Vec<ClaimedDelivery> {
        let now = now_ms();
        // The lease outlives the attempt's timeout: an attempt is only taken over when its
        // dispatcher is gone.
        let lease = 2 * self.config.timeout + Duration::from_secs(5);
        let lease_until = now.saturating_add(i64::try_from(lease.as_millis()).unwrap_or(i64::MAX));
        match self
            .hooks
            .claim_deliveries(&self.config.owner, lease_until, room, now)
            .await
        {
            Ok(claimed) => claimed,
            Err(error) => {
                tracing::warn!(%error, "cannot claim webhook deliveries");
                Vec::new()
            }
        }
    }

    /// Records how the attempts in `done` ended, in one transaction.
    async fn record(&self, done: Vec<Result<Attempt, tokio::task::JoinError>>) {
        let now = now_ms();
        let finished: Vec<_> = (done.into_iter())
            .filter_map(|done| {
                // A task that failed leaves its lease to expire: the attempt is made again.
                done.inspect_err(|error| tracing::error!(%error, "a webhook attempt task failed"))
                    .ok()
            })
            .map(|attempt| {
                let outcome = self.outcome(&attempt, now);
                (attempt.claim, outcome)
            })
            .collect();
        if finished.is_empty() {
            return;
        }
        match self.hooks.finish_deliveries(finished, now).await {
            Ok(recorded) => {
                let lost = recorded.iter().filter(|held| !**held).count();
                if lost > 0 {
                    tracing::warn!(
                        lost,
                        "webhook attempts finished after their claims were lost"
                    );
                }
            }
            // Unrecorded, the attempts are made again once their leases expire.
            Err(error) => tracing::warn!(%error, "cannot record webhook attempts"),
        }
    }

    fn outcome(&self, attempt: &Attempt, now: Millis) -> AttemptOutcome {
        match &attempt.answer {
            Answer::Status(status) if (200..300).contains(status) => {
                AttemptOutcome::Delivered { status: *status }
            }
            failed => {
                let (status, error) = match failed {
                    Answer::Status(status) => (
                        Some(*status),
                        format!("the receiver answered HTTP {status}"),
                    ),
                    Answer::Refused(refusal) => (None, format!("refused by policy: {refusal}")),
                    Answer::None => (None, NO_ANSWER.to_owned()),
                };
                let retry_at = match after_failure(
                    attempt.claim.attempt,
                    attempt.max_attempts,
                    self.config.backoff,
                    now,
                ) {
                    AfterFailure::RetryAt(at) => Some(at),
                    AfterFailure::DeadLetter => None,
                };
                AttemptOutcome::Failed {
                    status,
                    error,
                    retry_at,
                }
            }
        }
    }
}

/// Makes one attempt: the event as JSON, signed, POSTed to the webhook's URL if the policy
/// allows its destination.
async fn attempt(
    http: reqwest::Client,
    policy: WebhookPolicy,
    delivery: ClaimedDelivery,
) -> Attempt {
    // Webhooks created before the policy (or under a wider one) are checked again here; an
    // address in the URL is never resolved, so the resolver cannot check it.
    let answer = match Url::parse(&delivery.url) {
        Err(error) => Answer::Refused(Refusal::Unparsable(error.to_string())),
        Ok(url) => match policy.check_before_connect(&url) {
            Err(refusal) => Answer::Refused(refusal),
            Ok(()) => send(&http, url, &delivery).await,
        },
    };
    Attempt {
        claim: delivery.claim,
        max_attempts: delivery.max_attempts,
        answer,
    }
}

async fn send(http: &reqwest::Client, url: Url, delivery: &ClaimedDelivery) -> Answer {
    let body = json!({
        "webhook_id": delivery.webhook_id,
        "delivery_id": delivery.claim.delivery_id,
        "attempt": delivery.claim.attempt,
        "event": delivery.event,
    })
    .to_string();
    let timestamp = now_ms();
    let mut request = http.post(url);
    if let Some(traceparent) = &delivery.traceparent {
        request = request.header("traceparent", traceparent);
    }
    let sent = request
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header(
            SIGNATURE_HEADER,
            signature_header(&delivery.secret, timestamp, &body),
        )
        .header(DELIVERY_HEADER, delivery.claim.delivery_id.to_string())
        .header(EVENT_HEADER, &delivery.event.kind)
        .body(body)
        .send()
        .await;
    match sent {
        Ok(response) => Answer::Status(response.status().as_u16()),
        Err(error) => match refusal_in(&error) {
            Some(refusal) => Answer::Refused(refusal.clone()),
            None => {
                tracing::info!(
                    webhook = %delivery.webhook_id,
                    delivery = delivery.claim.delivery_id,
                    error = %chain(&error),
                    "a webhook attempt got no HTTP answer"
                );
                Answer::None
            }
        },
    }
}

/// The policy's refusal of a resolved name, wherever the HTTP client wrapped it.
fn refusal_in(error: &reqwest::Error) -> Option<&Refusal> {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(error) = cause {
        if let Some(refusal) = error.downcast_ref::<Refusal>() {
            return Some(refusal);
        }
        cause = error.source();
    }
    None
}

/// An error with its causes, for the operator's log.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(error) = cause {
        text.push_str(": ");
        text.push_str(&error.to_string());
        cause = error.source();
    }
    text
}

/// Resolves names for attempts, keeping only the addresses the policy allows: the check is
/// made on the very addresses the client connects to, so a name that resolves elsewhere
/// between the webhook's creation and an attempt (DNS rebinding) gains nothing.
struct Resolver {
    policy: WebhookPolicy,
}

impl reqwest::dns::Resolve for Resolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let policy = self.policy.clone();
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let resolved: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            if policy.allows_name(&host) {
                return Ok(Box::new(resolved.into_iter()) as reqwest::dns::Addrs);
            }
            let mut refused = None;
            let allowed: Vec<SocketAddr> = (resolved.into_iter())
                .filter(|address| match policy.check_addr(address.ip()) {
                    Ok(()) => true,
                    Err(refusal) => {
                        refused.get_or_insert(refusal);
                        false
                    }
                })
                .collect();
            match refused {
                Some(Refusal::Address { range, .. }) if allowed.is_empty() => {
                    let refused: Box<dyn std::error::Error + Send + Sync> =
                        Box::new(Refusal::Resolved { host, range });
                    Err(refused)
                }
                _ => Ok(Box::new(allowed.into_iter()) as reqwest::dns::Addrs),
            }
        })
    }
}

/// The signature header's value for `body` sent at `timestamp`.
pub fn signature_header(secret: &str, timestamp: Millis, body: &str) -> String {
    format!(
        "t={timestamp},v1={}",
        hmac_sha256_hex(secret.as_bytes(), format!("{timestamp}.{body}").as_bytes())
    )
}

/// Checks a signature header against `body` as a receiver would: the same secret must have
/// signed this very body at the timestamp the header names.
pub fn verify_signature(secret: &str, header: &str, body: &str) -> bool {
    let mut timestamp = None;
    let mut signature = None;
    for part in header.split(',') {
        match part.split_once('=') {
            Some(("t", value)) => timestamp = value.parse::<Millis>().ok(),
            Some(("v1", value)) => signature = Some(value),
            _ => {}
        }
    }
    let (Some(timestamp), Some(signature)) = (timestamp, signature) else {
        return false;
    };
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret.as_bytes()) else {
        return false;
    };
    mac.update(format!("{timestamp}.{body}").as_bytes());
    decode_hex(signature).is_some_and(|bytes| mac.verify_slice(&bytes).is_ok())
}

fn hmac_sha256_hex(key: &[u8], message: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(message);
    mac.finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

fn now_ms() -> Millis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 4231, test case 2: the signature is HMAC-SHA256 itself, not a look-alike.
    #[test]
    fn the_mac_is_hmac_sha256() {
        assert_eq!(
            hmac_sha256_hex(b"Jefe", b"what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn a_signature_verifies_only_for_its_secret_body_and_timestamp() {
        let header = signature_header("whsec_1", 1_700_000_000_000, r#"{"a":1}"#);
        assert!(header.starts_with("t=1700000000000,v1="), "{header}");
        assert!(verify_signature("whsec_1", &header, r#"{"a":1}"#));
        assert!(!verify_signature("whsec_2", &header, r#"{"a":1}"#));
        assert!(!verify_signature("whsec_1", &header, r#"{"a":2}"#));
        let moved = header.replace("t=1700000000000", "t=1700000000001");
        assert!(!verify_signature("whsec_1", &moved, r#"{"a":1}"#));
        assert!(!verify_signature("whsec_1", "v1=00", r#"{"a":1}"#));
        assert!(!verify_signature("whsec_1", "t=1,v1=zz", r#"{"a":1}"#));
    }
}
