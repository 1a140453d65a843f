//! Webhooks, the observation plane's plugins: where the delivery of one event to one webhook
//! stands, the one table its status moves along, and when a failed attempt is tried again.
//!
//! A webhook only ever reads events: its deliveries live in their own records and nothing
//! about them can change a run.

use serde::{Deserialize, Serialize};

use crate::Millis;

/// Where the delivery of one event to one webhook stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryStatus {
    /// Waiting for its attempt (from `available_at`), behind the earlier events of its session.
    Pending,
    /// An attempt is in flight, held by a dispatcher until its lease expires.
    Delivering,
    /// The receiver answered an attempt with a 2xx status.
    Delivered,
    /// Given up on after the webhook's maximum number of attempts.
    DeadLetter,
}

/// A delivery status change the table below does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("illegal delivery edge: {from:?} -> {to:?}")]
pub struct IllegalDeliveryEdge {
    pub from: DeliveryStatus,
    pub to: DeliveryStatus,
}

impl DeliveryStatus {
    pub const ALL: [DeliveryStatus; 4] = [
        DeliveryStatus::Pending,
        DeliveryStatus::Delivering,
        DeliveryStatus::Delivered,
        DeliveryStatus::DeadLetter,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Delivering => "delivering",
            DeliveryStatus::Delivered => "delivered",
            DeliveryStatus::DeadLetter => "dead_letter",
        }
    }

    pub fn parse(text: &str) -> Option<DeliveryStatus> {
        DeliveryStatus::ALL.into_iter().find(|s| s.as_str() == text)
    }

    /// Still to be attempted: it holds back the later events of its session.
    pub fn is_open(self) -> bool {
        matches!(self, DeliveryStatus::Pending | DeliveryStatus::Delivering)
    }

    /// The one table of legal delivery edges. An attempt starts from pending, or again from
    /// delivering when the dispatcher holding it died (its lease expired); it ends delivered,
    /// pending for a later attempt, or dead after the last one. A pending one too old, or
    /// beyond its session's bound on open deliveries, is dead-lettered. An operator may requeue
    /// a dead one: pending again, its attempts counted afresh.
    pub fn edge(self, to: DeliveryStatus) -> Result<(), IllegalDeliveryEdge> {
        use DeliveryStatus::*;
        let legal = match self {
            Pending => matches!(to, Delivering | DeadLetter),
            Delivering => matches!(to, Delivering | Delivered | Pending | DeadLetter),
            DeadLetter => to == Pending,
            Delivered => false,
        };
        if legal {
            Ok(())
        } else {
            Err(IllegalDeliveryEdge { from: self, to })
        }
    }
}

/// How failed attempts are spaced: doubling from `first_ms`, never more than `max_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub first_ms: u64,
    pub max_ms: u64,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            first_ms: 1_000,
            max_ms: 600_000,
        }
    }
}

impl Backoff {
    /// The wait after the `attempts`-th failed attempt (the first is 1).
    pub fn after(self, attempts: u32) -> u64 {
        let doublings = attempts.saturating_sub(1).min(63);
        self.first_ms
            .saturating_mul(1u64 << doublings)
            .min(self.max_ms)
    }
}

/// What follows a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterFailure {
    /// Pending again, due at this time.
    RetryAt(Millis),
    DeadLetter,
}

/// The attempt numbered `attempts` (the first is 1) failed at `now`: another one after the
/// backoff, unless it was the last of `max_attempts`.
pub fn after_failure(
    attempts: u32,
    max_attempts: u32,
    backoff: Backoff,
    now: Millis,
) -> AfterFailure {
    if attempts >= max_attempts {
        AfterFailure::DeadLetter
    } else {
        let wait = i64::try_from(backoff.after(attempts)).unwrap_or(i64::MAX);
        AfterFailure::RetryAt(now.saturating_add(wait))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_delivery_edge_table_is_exactly_this() {
        use DeliveryStatus::*;
        let legal = [
            (Pending, Delivering),
            (Pending, DeadLetter),
            (Delivering, Delivering),
            (Delivering, Delivered),
            (Delivering, Pending),
            (Delivering, DeadLetter),
            (DeadLetter, Pending),
        ];
        for from in DeliveryStatus::ALL {
            for to in DeliveryStatus::ALL {
                assert_eq!(
                    from.edge(to).is_ok(),
                    legal.contains(&(from, to)),
                    "{from:?} -> {to:?}"
                );
            }
        }
    }

    #[test]
    fn statuses_round_trip_through_their_names() {
        for status in DeliveryStatus::ALL {
            assert_eq!(DeliveryStatus::parse(status.as_str()), Some(status));
            assert_eq!(
                serde_json::to_value(status).unwrap(),
                serde_json::json!(status.as_str())
            );
        }
        assert_eq!(DeliveryStatus::parse("failed"), None);
        assert!(DeliveryStatus::Pending.is_open() && DeliveryStatus::Delivering.is_open());
        assert!(!DeliveryStatus::Delivered.is_open() && !DeliveryStatus::DeadLetter.is_open());
    }

    #[test]
    fn backoff_doubles_up_to_its_cap_without_overflowing() {
        let backoff = Backoff {
            first_ms: 100,
            max_ms: 1_000,
        };
        let waits: Vec<u64> = (1..=6).map(|n| backoff.after(n)).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1_000, 1_000]);
        assert_eq!(backoff.after(0), 100);
        assert_eq!(backoff.after(u32::MAX), 1_000);
        let huge = Backoff {
            first_ms: u64::MAX / 2,
            max_ms: u64::MAX,
        };
        assert_eq!(huge.after(10), u64::MAX);
    }

    #[test]
    fn a_failure_is_retried_until_the_last_attempt() {
        let backoff = Backoff {
            first_ms: 100,
            max_ms: 1_000,
        };
        assert_eq!(
            after_failure(1, 3, backoff, 5_000),
            AfterFailure::RetryAt(5_100)
        );
        assert_eq!(
            after_failure(2, 3, backoff, 5_000),
            AfterFailure::RetryAt(5_200)
        );
        assert_eq!(
            after_failure(3, 3, backoff, 5_000),
            AfterFailure::DeadLetter
        );
        assert_eq!(
            after_failure(1, 1, backoff, 5_000),
            AfterFailure::DeadLetter
        );
        let forever = Backoff {
            first_ms: u64::MAX,
            max_ms: u64::MAX,
        };
        assert_eq!(
            after_failure(1, 2, forever, 5_000),
            AfterFailure::RetryAt(i64::MAX)
        );
    }
}
