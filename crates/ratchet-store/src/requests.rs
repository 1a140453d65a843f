//! Idempotent requests: what the store keeps of a request a client named with an
//! `Idempotency-Key`, and the one decision about a repeat of it.
//!
//! The first request with a key takes the key (`Writes::begin_request`) and holds it while it
//! is carried out. A request whose effect is one transaction records that effect in the key's
//! row within that same transaction (`NewRun::request`, `SessionSpec::request`), so that when
//! its process dies between the commit and storing the response, a repeat answers from the
//! recorded effect instead of doing it again. A fork (`NewFork::request`), a new schedule
//! (`NewSchedule::request`), a schedule's manual slot (`Writes::trigger_schedule`), a continue
//! or retry (`Writes::resume_failed`), a new webhook (`NewWebhook::request`) and a rotated
//! secret (`WebhookAdmin::rotate_webhook_secret`) do the same. Once answered, the response is kept
//! (`Writes::finish_request`) and every repeat until the key expires gets it back.

use ratchet_core::{MessageId, Millis, RunId, RunStatus, ScheduleId, SessionId, WebhookId};
use serde::{Deserialize, Serialize};

/// The longest key a client may send, in characters.
pub const MAX_KEY_CHARS: usize = 255;

/// A key as a tenant sent it: keys of different tenants never meet.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestKey {
    pub tenant: String,
    pub key: String,
}

impl RequestKey {
    /// The tenant's key, if `key` is 1 to `MAX_KEY_CHARS` printable ASCII characters.
    pub fn parse(tenant: &str, key: &str) -> Result<RequestKey, String> {
        let printable = key.bytes().all(|byte| (0x20..=0x7e).contains(&byte));
        if key.is_empty() || key.len() > MAX_KEY_CHARS || !printable {
            return Err(format!(
                "Idempotency-Key must be 1 to {MAX_KEY_CHARS} printable ASCII characters; \
                 found {} bytes{}",
                key.len(),
                if printable {
                    ""
                } else {
                    " with a character outside printable ASCII"
                }
            ));
        }
        Ok(RequestKey {
            tenant: tenant.to_owned(),
            key: key.to_owned(),
        })
    }
}

/// A keyed request as it arrives: what the key will be bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyedRequest {
    pub key: RequestKey,
    pub method: String,
    pub path: String,
    /// A digest of the body, so that the same key with another body is told apart.
    pub body_hash: String,
    /// Until when the request holds the key while it is carried out, if it takes it. A
    /// repeat within the hold is refused as in progress; past it, the request's process is
    /// taken for dead and a repeat takes the key over.
    pub held_until: Millis,
    /// When the key and its response are forgotten.
    pub expires_at: Millis,
}

/// Proof that a request holds its key. `attempt` changes each time a repeat takes the key
/// over from a request presumed dead, so that an effect recorded with an earlier mark is
/// refused and the request that was presumed dead does nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestMark {
    pub key: RequestKey,
    pub attempt: i64,
}

/// A response as the first request with its key answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    pub body: String,
}

/// What a keyed request's transaction did, recorded with the key in that transaction: enough
/// to answer the request again without doing it again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Effect {
    /// A message was accepted (`Writes::submit_message`).
    Submitted {
        message_id: MessageId,
        run_id: RunId,
        status: RunStatus,
        steered: bool,
    },
    /// A session was created (`Writes::create_session`).
    SessionCreated { session_id: SessionId },
    /// A run was forked (`Writes::fork_run`) into a new session.
    Forked {
        source: RunId,
        at_step: u64,
        session_id: SessionId,
        run_id: RunId,
        status: RunStatus,
    },
    /// A schedule was created (`Writes::create_schedule`).
    ScheduleCreated { schedule_id: ScheduleId },
    /// A schedule was fired by hand (`Writes::trigger_schedule`): its manual slot at `slot`.
    ScheduleTriggered {
        schedule_id: ScheduleId,
        slot: Millis,
    },
    /// A failed run was continued or retried (`Writes::resume_failed`).
    Resumed { run_id: RunId },
    /// A webhook was created (`WebhookAdmin::create_webhook`). Its secret is not recorded:
    /// the store keeps no secret in clear.
    WebhookCreated { webhook_id: WebhookId },
    /// A webhook's secret was replaced (`WebhookAdmin::rotate_webhook_secret`); the secret is
    /// not recorded.
    SecretRotated { webhook_id: WebhookId },
}

impl Effect {
    /// What accepting message `message_id` as run `run_id` did: the run it went to (the
    /// active one it steered, or its own) and that run's status.
    pub fn submitted(message_id: MessageId, run_id: RunId, submitted: &crate::Submitted) -> Effect {
        Effect::Submitted {
            message_id,
            run_id: submitted.steered_into.clone().unwrap_or(run_id),
            status: submitted.status,
            steered: submitted.steered_into.is_some(),
        }
    }
}

/// What the store holds of a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    pub method: String,
    pub path: String,
    pub body_hash: String,
    pub attempt: i64,
    /// Until when the request carrying it out holds the key; meaningless once answered.
    pub held_until: Millis,
    pub expires_at: Millis,
    pub effect: Option<Effect>,
    pub response: Option<StoredResponse>,
}

/// What to do with a keyed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestClaim {
    /// Carry the request out, holding the key with this mark.
    Execute(RequestMark),
    /// The key was answered: send this back and do nothing.
    Replay(StoredResponse),
    /// The request's effect was committed, but whoever carried it out died before answering:
    /// answer from the effect, holding the key with this mark, and do nothing again.
    Recovered { mark: RequestMark, effect: Effect },
    /// Another request with the key is being carried out, until `held_until` at the latest.
    InProgress { held_until: Millis },
    /// The key was first used for another request (another method, path or body).
    Mismatch { method: String, path: String },
}

impl RequestClaim {
    /// The claim of `request` given what the store holds of its key now, and — when the key
    /// is taken — the attempt it is taken with (the row to write, held until
    /// `request.held_until`). An expired record counts as none.
    pub fn decide(
        record: Option<&KeyRecord>,
        request: &KeyedRequest,
        now: Millis,
    ) -> (RequestClaim, Option<i64>) {
        let mark = |attempt| RequestMark {
            key: request.key.clone(),
            attempt,
        };
        let Some(record) = record.filter(|record| record.expires_at > now) else {
            let attempt = record.map_or(1, |expired| expired.attempt + 1);
            return (RequestClaim::Execute(mark(attempt)), Some(attempt));
        };
        let same = record.method == request.method
            && record.path == request.path
            && record.body_hash == request.body_hash;
        if !same {
            let mismatch = RequestClaim::Mismatch {
                method: record.method.clone(),
                path: record.path.clone(),
            };
            return (mismatch, None);
        }
        if let Some(response) = &record.response {
            return (RequestClaim::Replay(response.clone()), None);
        }
        if record.held_until > now {
            let held_until = record.held_until;
            return (RequestClaim::InProgress { held_until }, None);
        }
        let attempt = record.attempt + 1;
        let claim = match &record.effect {
            Some(effect) => RequestClaim::Recovered {
                mark: mark(attempt),
                effect: effect.clone(),
            },
            None => RequestClaim::Execute(mark(attempt)),
        };
        (claim, Some(attempt))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> KeyedRequest {
        KeyedRequest {
            key: RequestKey::parse("default", "k-1").unwrap(),
            method: "POST".into(),
            path: "/v1/sessions".into(),
            body_hash: "h".into(),
            held_until: 40,
            expires_at: 1_000_000,
        }
    }

    fn record() -> KeyRecord {
        KeyRecord {
            method: "POST".into(),
            path: "/v1/sessions".into(),
            body_hash: "h".into(),
            attempt: 3,
            held_until: 500,
            expires_at: 1_000_000,
            effect: None,
            response: None,
        }
    }

    fn effect() -> Effect {
        Effect::SessionCreated {
            session_id: SessionId::from_suffix("a").unwrap(),
        }
    }

    fn response() -> StoredResponse {
        StoredResponse {
            status: 201,
            body: "{}".into(),
        }
    }

    fn executes(attempt: i64) -> (RequestClaim, Option<i64>) {
        let mark = RequestMark {
            key: request().key,
            attempt,
        };
        (RequestClaim::Execute(mark), Some(attempt))
    }

    #[test]
    fn a_key_never_seen_or_expired_is_taken() {
        assert_eq!(RequestClaim::decide(None, &request(), 10), executes(1));
        let expired = KeyRecord {
            expires_at: 10,
            response: Some(response()),
            ..record()
        };
        assert_eq!(
            RequestClaim::decide(Some(&expired), &request(), 10),
            executes(4)
        );
    }

    #[test]
    fn another_method_path_or_body_is_a_mismatch_whatever_the_state() {
        let changes: [fn(&mut KeyRecord); 3] = [
            |r| r.method = "PATCH".into(),
            |r| r.path = "/v1/sessions/ses_x/messages".into(),
            |r| r.body_hash = "other".into(),
        ];
        for change in changes {
            for (response, held_until) in [(None, 10_000), (None, 5), (Some(response()), 5)] {
                let mut other = KeyRecord {
                    response,
                    held_until,
                    ..record()
                };
                change(&mut other);
                let (claim, taken) = RequestClaim::decide(Some(&other), &request(), 10);
                assert!(matches!(claim, RequestClaim::Mismatch { .. }), "{claim:?}");
                assert_eq!(taken, None);
            }
        }
    }

    #[test]
    fn an_answered_key_is_replayed_even_past_its_hold() {
        for held_until in [5, 10_000] {
            let answered = KeyRecord {
                response: Some(response()),
                effect: Some(effect()),
                held_until,
                ..record()
            };
            assert_eq!(
                RequestClaim::decide(Some(&answered), &request(), 10),
                (RequestClaim::Replay(response()), None)
            );
        }
    }

    #[test]
    fn a_held_key_is_in_progress_with_or_without_an_effect() {
        for effect in [None, Some(effect())] {
            let held = KeyRecord {
                held_until: 11,
                effect,
                ..record()
            };
            assert_eq!(
                RequestClaim::decide(Some(&held), &request(), 10),
                (RequestClaim::InProgress { held_until: 11 }, None)
            );
        }
    }

    #[test]
    fn a_key_whose_holder_died_is_taken_over_and_answered_from_its_effect_if_any() {
        let abandoned = KeyRecord {
            held_until: 10,
            ..record()
        };
        assert_eq!(
            RequestClaim::decide(Some(&abandoned), &request(), 10),
            executes(4)
        );
        let committed = KeyRecord {
            effect: Some(effect()),
            ..abandoned
        };
        let mark = RequestMark {
            key: request().key,
            attempt: 4,
        };
        assert_eq!(
            RequestClaim::decide(Some(&committed), &request(), 10),
            (
                RequestClaim::Recovered {
                    mark,
                    effect: effect()
                },
                Some(4)
            )
        );
    }

    #[test]
    fn keys_are_one_to_255_printable_ascii_characters() {
        assert!(RequestKey::parse("t", "a").is_ok());
        assert!(RequestKey::parse("t", &"k".repeat(255)).is_ok());
        assert!(RequestKey::parse("t", "key with spaces ~!").is_ok());
        for bad in ["", &"k".repeat(256), "tab\there", "ünï", "nl\n"] {
            let error = RequestKey::parse("t", bad).unwrap_err();
            assert!(error.contains("1 to 255 printable ASCII"), "{error}");
        }
    }
}
