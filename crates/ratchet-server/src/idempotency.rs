//! `Idempotency-Key` on every `POST` under `/v1`. The first request with a key is carried
//! out and its response kept; a repeat gets that response back (`Idempotent-Replayed: true`)
//! and does nothing. The same key with another method, path or body is refused (422), and a
//! repeat while the first is still being carried out too (409).
//!
//! The key is taken before the handler runs and the response kept after it; the handlers
//! whose effect is one transaction (a message, a new session, a fork, a new schedule, a
//! schedule's manual slot) record the effect with the key
//! in that transaction (`KeyedRequest` → `RequestMark` in the request's extensions), so that
//! a process that dies between its commit and keeping the response leaves a key a repeat
//! answers from (`RequestClaim::Recovered`). A response that did nothing and may come out
//! otherwise later — a conflict (409), a quota (429), a failure (5xx) — is not kept: the key
//! is given back and a repeat is carried out.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, Request, State};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use ratchet_core::Millis;
use ratchet_store::{Effect, KeyedRequest, RequestClaim, RequestKey, RequestMark, StoredResponse};
use sha2::{Digest, Sha256};

use crate::AppState;
use crate::api::MessageAccepted;
use crate::auth::Tenant;
use crate::error::ApiError;

pub use ratchet_store::requests::MAX_KEY_CHARS;

pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// How long a key is kept by default: a day.
pub const DEFAULT_TTL_MS: Millis = 24 * 60 * 60 * 1000;

/// How long a request holds its key by default while it is carried out: far longer than any
/// handler takes, and what a repeat waits at most after the process carrying it out died.
pub const DEFAULT_HOLD_MS: Millis = 30_000;

/// How often a process sweeps expired keys, at most.
const SWEEP_EVERY_MS: Millis = 60_000;

/// How keys are kept: for how long, how long a request holds its key, and when this process
/// last swept the expired ones.
#[derive(Debug)]
pub struct KeyPolicy {
    ttl_ms: Millis,
    hold_ms: Millis,
    last_sweep: AtomicI64,
}

impl KeyPolicy {
    pub fn new(ttl_ms: Millis, hold_ms: Millis) -> Arc<KeyPolicy> {
        Arc::new(KeyPolicy {
            ttl_ms,
            hold_ms,
            last_sweep: AtomicI64::new(0),
        })
    }

    /// True when this process should sweep now (and is taken to, until the next period).
    fn sweep_due(&self, now: Millis) -> bool {
        let last = self.last_sweep.load(Ordering::Relaxed);
        now - last >= SWEEP_EVERY_MS
            && (self.last_sweep)
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

/// The middleware: passes every request without a key (and every one that is not a `POST`
/// under `/v1`) straight on.
pub(crate) async fn keyed(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let keyed = request.method() == Method::POST
        && request.uri().path().starts_with("/v1/")
        && request.headers().contains_key(IDEMPOTENCY_KEY);
    if !keyed {
        return next.run(request).await;
    }
    match carry_out(state, request, next).await {
        Ok(response) | Err(response) => response,
    }
}

async fn carry_out(state: AppState, request: Request, next: Next) -> Result<Response, Response> {
    let (mut parts, body) = request.into_parts();
    let tenant = (Tenant::from_request_parts(&mut parts, &state).await)
        .map_err(IntoResponse::into_response)?;
    let sent = parts
        .headers
        .get(IDEMPOTENCY_KEY)
        .map(HeaderValue::as_bytes);
    let sent = sent.map(String::from_utf8_lossy).unwrap_or_default();
    let key = RequestKey::parse(&tenant.0, &sent)
        .map_err(|message| ApiError::bad_request(message).into_response())?;
    let bytes = axum::body::to_bytes(body, crate::api::MAX_BODY_BYTES)
        .await
        .map_err(|_| too_large())?;
    let now = state.coordinator.now();
    let policy = Arc::clone(&state.keys);
    if policy.sweep_due(now) {
        let coordinator = Arc::clone(&state.coordinator);
        tokio::spawn(async move {
            if let Err(error) = coordinator.sweep_requests().await {
                tracing::warn!(%error, "sweeping expired idempotency keys failed");
            }
        });
    }
    let request_path = (parts.uri.path_and_query()).map_or(String::new(), |p| p.to_string());
    let keyed = KeyedRequest {
        key: key.clone(),
        method: parts.method.to_string(),
        path: request_path.clone(),
        body_hash: body_hash(&bytes),
        held_until: now.saturating_add(policy.hold_ms),
        expires_at: now.saturating_add(policy.ttl_ms),
    };
    let claim = (state.coordinator.begin_request(keyed).await)
        .map_err(|error| ApiError::from(error).into_response())?;
    match claim {
        RequestClaim::Execute(mark) => {
            parts.extensions.insert(mark.clone());
            let request = Request::from_parts(parts, Body::from(bytes));
            Ok(keep(&state, &mark, next.run(request).await).await)
        }
        RequestClaim::Replay(stored) => Ok(replayed(stored)),
        RequestClaim::Recovered { mark, effect } => {
            let answer = answer_from(&state, effect).await;
            Ok(keep(&state, &mark, answer).await)
        }
        RequestClaim::InProgress { held_until } => {
            let wait_s = ((held_until - now).max(0) + 999) / 1000;
            let mut response = ApiError::new(
                StatusCode::CONFLICT,
                "request_in_progress",
                format!(
                    "a request with Idempotency-Key {:?} is still being carried out; send it \
                     again once it is done (within {wait_s} s)",
                    key.key
                ),
            )
            .into_response();
            if let Ok(value) = HeaderValue::from_str(&wait_s.max(1).to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, value);
            }
            Err(response)
        }
        RequestClaim::Mismatch { method, path } => Err(ApiError::unprocessable(format!(
            "Idempotency-Key {:?} was first used for {method} {path} with its own body; expected \
             the same request again, found {method_now} {request_path}{body_note}: a key names \
             one request",
            key.key,
            method_now = parts.method,
            body_note = if method == parts.method.as_str() && path == request_path {
                " with another body"
            } else {
                ""
            },
        ))
        .into_response()),
    }
}

/// A digest of the body that two bodies meaning the same JSON share (keys in any order,
/// any white space); a body that is not JSON is taken byte for byte.
fn body_hash(bytes: &Bytes) -> String {
    let canonical = serde_json::from_slice::<serde_json::Value>(bytes)
        .map(|value| value.to_string().into_bytes())
        .unwrap_or_else(|_| bytes.to_vec());
    let digest = Sha256::digest(&canonical);
    digest.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Keeps `response` as the key's answer when it is one a repeat should get, and gives the key
/// back otherwise; either way the response goes out as it is.
async fn keep(state: &AppState, mark: &RequestMark, response: Response) -> Response {
    let status = response.status();
    let settled = !matches!(status, StatusCode::CONFLICT | StatusCode::TOO_MANY_REQUESTS)
        && (status.is_success() || status.is_client_error());
    if !settled {
        if let Err(error) = state.coordinator.abandon_request(mark).await {
            tracing::warn!(%error, "giving an idempotency key back failed");
        }
        return response;
    }
    let (head, body) = response.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, usize::MAX).await else {
        return ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "the response could not be read to be kept",
        )
        .into_response();
    };
    let stored = StoredResponse {
        status: status.as_u16(),
        body: String::from_utf8_lossy(&bytes).into_owned(),
    };
    match state.coordinator.finish_request(mark, stored).await {
        Ok(true) => {}
        Ok(false) => tracing::warn!(
            key = mark.key.key,
            "a repeat took the idempotency key over before the response was kept"
        ),
        Err(error) => tracing::warn!(%error, "keeping a keyed request's response failed"),
    }
    Response::from_parts(head, Body::from(bytes))
}

fn replayed(stored: StoredResponse) -> Response {
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let mut response = (status, stored.body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

/// The answer to a request whose effect was committed by a process that died before
/// answering: what the handler would have said of that effect.
async fn answer_from(state: &AppState, effect: Effect) -> Response {
    let mut response = match effect {
        Effect::Submitted {
            message_id,
            run_id,
            status,
            steered,
        } => {
            let accepted = MessageAccepted {
                message_id: message_id.to_string(),
                run_id: run_id.to_string(),
                run_status: status.to_string(),
                steered,
            };
            (StatusCode::ACCEPTED, axum::Json(accepted)).into_response()
        }
        Effect::SessionCreated { session_id } => {
            match state.coordinator.store().get_session(&session_id).await {
                Ok(session) => {
                    let view = crate::api::SessionView::from(session);
                    (StatusCode::CREATED, axum::Json(view)).into_response()
                }
                Err(error) => return ApiError::from(error).into_response(),
            }
        }
        Effect::Forked {
            source,
            at_step,
            session_id,
            run_id,
            status,
        } => {
            let view = crate::api::ForkedView {
                session_id: session_id.to_string(),
                run_id: run_id.to_string(),
                status: status.to_string(),
                forked_from: crate::api::ForkedFromView {
                    run_id: source.to_string(),
                    step: at_step,
                },
            };
            (StatusCode::CREATED, axum::Json(view)).into_response()
        }
        Effect::ScheduleCreated { schedule_id } => {
            match state.coordinator.store().get_schedule(&schedule_id).await {
                Ok(schedule) => {
                    let view = crate::schedules::ScheduleView::from(schedule);
                    (StatusCode::CREATED, axum::Json(view)).into_response()
                }
                Err(error) => return ApiError::from(error).into_response(),
            }
        }
        Effect::ScheduleTriggered { schedule_id, slot } => {
            let after = ratchet_store::SlotCursor {
                slot: slot.saturating_add(1),
                manual: false,
            };
            let store = state.coordinator.store();
            let slots = match store.schedule_slots(&schedule_id, Some(after), 2).await {
                Ok(slots) => slots,
                Err(error) => return ApiError::from(error).into_response(),
            };
            match slots.into_iter().find(|s| s.slot == slot && s.manual) {
                Some(fired) => {
                    let view = crate::schedules::ScheduleRunView::from(fired);
                    (StatusCode::ACCEPTED, axum::Json(view)).into_response()
                }
                None => {
                    let missing = format!(
                        "schedule {schedule_id} has no manual slot at {slot}, which a keyed trigger recorded"
                    );
                    return ApiError::internal(&missing).into_response();
                }
            }
        }
        Effect::Resumed { run_id } => {
            axum::Json(crate::api::ResumedView::running(&run_id)).into_response()
        }
        Effect::WebhookCreated { webhook_id } => {
            match state.webhooks.get_webhook(&webhook_id).await {
                Ok(webhook) => {
                    let view = crate::webhooks::WebhookView {
                        secret_withheld: true,
                        ..webhook.into()
                    };
                    (StatusCode::CREATED, axum::Json(view)).into_response()
                }
                Err(error) => return ApiError::from(error).into_response(),
            }
        }
        Effect::SecretRotated { webhook_id } => {
            let rotated = crate::webhooks::RotatedSecret {
                id: webhook_id.to_string(),
                secret: None,
                secret_withheld: true,
            };
            axum::Json(rotated).into_response()
        }
    };
    (response.headers_mut()).insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

fn too_large() -> Response {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
        format!(
            "the body is over the {} bytes accepted",
            crate::api::MAX_BODY_BYTES
        ),
    )
    .into_response()
}
