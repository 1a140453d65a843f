//! Idempotent requests: a key per tenant, taken as `RequestClaim::decide` says, the effect a
//! keyed request's write records, its response, and expired keys swept.

use std::collections::BTreeMap;

use ratchet_core::Millis;
use ratchet_store::{
    Effect, Error, KeyRecord, KeyedRequest, RequestClaim, RequestMark, Result, StoredResponse,
};

use crate::tables::Tables;

/// The keys, by (tenant, key).
pub(crate) type Requests = BTreeMap<(String, String), KeyRecord>;

fn id(mark: &RequestMark) -> (String, String) {
    (mark.key.tenant.clone(), mark.key.key.clone())
}

impl Tables {
    pub(crate) fn begin_request(&mut self, request: KeyedRequest, now: Millis) -> RequestClaim {
        let id = (request.key.tenant.clone(), request.key.key.clone());
        let record = self.requests.get(&id);
        let (claim, taken) = RequestClaim::decide(record, &request, now);
        if let Some(attempt) = taken {
            let kept = record
                .filter(|record| record.expires_at > now)
                .map(|record| (record.expires_at, record.effect.clone()));
            let (expires_at, effect) = kept.unwrap_or((request.expires_at, None));
            self.requests.insert(
                id,
                KeyRecord {
                    method: request.method,
                    path: request.path,
                    body_hash: request.body_hash,
                    attempt,
                    held_until: request.held_until,
                    expires_at,
                    effect,
                    response: None,
                },
            );
        }
        claim
    }

    /// Records what a keyed request's write did, as part of that write; refuses when the mark
    /// no longer holds the key (and the write, refused, keeps nothing).
    pub(crate) fn record_effect(&mut self, mark: &RequestMark, effect: Effect) -> Result<()> {
        match self.requests.get_mut(&id(mark)) {
            Some(record) if record.attempt == mark.attempt && record.response.is_none() => {
                record.effect = Some(effect);
                Ok(())
            }
            _ => Err(Error::Conflict(format!(
                "the request with Idempotency-Key {:?} no longer holds its key (attempt {}): a \
                 repeat took it over; nothing was done",
                mark.key.key, mark.attempt
            ))),
        }
    }

    pub(crate) fn finish_request(&mut self, mark: &RequestMark, response: StoredResponse) -> bool {
        match self.requests.get_mut(&id(mark)) {
            Some(record) if record.attempt == mark.attempt && record.response.is_none() => {
                record.response = Some(response);
                true
            }
            _ => false,
        }
    }

    pub(crate) fn abandon_request(&mut self, mark: &RequestMark) {
        let id = id(mark);
        let unused = self.requests.get(&id).is_some_and(|record| {
            record.attempt == mark.attempt && record.response.is_none() && record.effect.is_none()
        });
        if unused {
            self.requests.remove(&id);
        }
    }

    pub(crate) fn sweep_requests(&mut self, now: Millis) -> u64 {
        let before = self.requests.len();
        self.requests.retain(|_, record| record.expires_at > now);
        (before - self.requests.len()) as u64
    }
}
