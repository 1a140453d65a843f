//! How many event streams may be open at once: per tenant and in all. A stream holds a
//! connection and a little memory for as long as its client keeps it, so without a cap one
//! tenant could hold the whole process; past either cap a new stream is refused with 429.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;

use crate::ApiError;

/// `[limits] max_streams` and `max_streams_per_tenant`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamLimits {
    /// Streams open at once in this process.
    pub max_streams: usize,
    /// Streams one tenant may hold open at once.
    pub max_streams_per_tenant: usize,
}

impl Default for StreamLimits {
    fn default() -> StreamLimits {
        StreamLimits {
            max_streams: 1024,
            max_streams_per_tenant: 64,
        }
    }
}

/// Counts open streams; the only writer of the counts. The lock is held for a map update,
/// never across an await.
#[derive(Debug, Default)]
pub(crate) struct StreamGate {
    limits: StreamLimits,
    open: Mutex<Open>,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    by_tenant: HashMap<String, usize>,
}

/// One open stream. Dropping it (the client left, the stream ended) gives its place back.
#[derive(Debug)]
pub(crate) struct StreamPermit {
    gate: Arc<StreamGate>,
    tenant: String,
}

impl StreamGate {
    pub(crate) fn new(limits: StreamLimits) -> Arc<StreamGate> {
        Arc::new(StreamGate {
            limits,
            open: Mutex::default(),
        })
    }

    /// A place for one more stream of `tenant`, or 429 naming the cap that is reached.
    pub(crate) fn open(self: &Arc<Self>, tenant: &str) -> Result<StreamPermit, ApiError> {
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let of_tenant = open.by_tenant.get(tenant).copied().unwrap_or(0);
        let refused = if of_tenant >= self.limits.max_streams_per_tenant {
            Some(format!(
                "this tenant already has {of_tenant} event streams open, the most allowed \
                 ([limits] max_streams_per_tenant); close one and retry"
            ))
        } else if open.total >= self.limits.max_streams {
            Some(format!(
                "the server already has {} event streams open, the most allowed \
                 ([limits] max_streams); retry later",
                open.total
            ))
        } else {
            None
        };
        if let Some(message) = refused {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_streams",
                message,
            ));
        }
        open.total += 1;
        *open.by_tenant.entry(tenant.to_owned()).or_default() += 1;
        metrics::gauge!("ratchet_sse_subscribers").increment(1.0);
        Ok(StreamPermit {
            gate: Arc::clone(self),
            tenant: tenant.to_owned(),
        })
    }

    /// Streams open now, in all.
    #[cfg(test)]
    pub(crate) fn open_streams(&self) -> usize {
        self.open.lock().map_or(0, |open| open.total)
    }
}

impl Drop for StreamPermit {
    fn drop(&mut self) {
        let mut open = (self.gate.open.lock()).unwrap_or_else(|poisoned| poisoned.into_inner());
        open.total -= 1;
        if let Some(count) = open.by_tenant.get_mut(&self.tenant) {
            *count -= 1;
            if *count == 0 {
                open.by_tenant.remove(&self.tenant);
            }
        }
        metrics::gauge!("ratchet_sse_subscribers").decrement(1.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_capped_per_tenant_and_in_all_and_places_come_back_on_drop() {
        let gate = StreamGate::new(StreamLimits {
            max_streams: 3,
            max_streams_per_tenant: 2,
        });
        let a1 = gate.open("a").unwrap();
        let _a2 = gate.open("a").unwrap();
        let refused = gate.open("a").unwrap_err();
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        assert!(
            refused.message.contains("max_streams_per_tenant"),
            "{refused:?}"
        );
        let _b1 = gate.open("b").unwrap();
        let refused = gate.open("c").unwrap_err();
        assert!(
            refused.message.contains("[limits] max_streams)"),
            "{refused:?}"
        );
        drop(a1);
        assert_eq!(gate.open_streams(), 2);
        let _c1 = gate.open("c").unwrap();
        assert_eq!(gate.open_streams(), 3);
    }
}
