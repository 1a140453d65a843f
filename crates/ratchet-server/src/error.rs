//! The API's one error type and the extractors that turn every bad input into it. Each error
//! is JSON `{"error": {"code", "message"}}`, with `problems` beside them when a request has
//! several (a rejected reload); internal details are logged, never shown.

use std::any::Any;

use axum::body::{Body, Bytes};
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, OptionalFromRequest, Request};
use axum::http::HeaderValue;
use axum::http::StatusCode;
use axum::http::header::{CONNECTION, CONTENT_LENGTH};
use axum::http::request::Parts;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;

use crate::api::{ErrorBody, ErrorDetail};

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// Shown as `error.problems` when not empty.
    pub problems: Vec<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
            problems: Vec::new(),
        }
    }

    /// The same error, listing every problem found.
    pub fn with_problems(mut self, problems: Vec<String>) -> ApiError {
        self.problems = problems;
        self
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    pub fn unprocessable(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_request", message)
    }

    pub(crate) fn internal(error: &dyn std::fmt::Display) -> ApiError {
        tracing::error!(%error, "request failed inside the server");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "the server failed to handle this request; it has been logged",
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.to_owned(),
                message: self.message,
                problems: self.problems,
            },
        };
        let mut response = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::PAYLOAD_TOO_LARGE {
            // The body is left unread, so the server drops the connection after this answer;
            // saying so keeps a client from sending its next request down a closing socket.
            response
                .headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}

impl From<ratchet_store::Error> for ApiError {
    fn from(error: ratchet_store::Error) -> ApiError {
        use ratchet_store::Error;
        match error {
            Error::NotFound { kind, id } => ApiError::not_found(format!("no {kind} {id}")),
            Error::Conflict(message) => ApiError::new(StatusCode::CONFLICT, "conflict", message),
            Error::Invalid(message) => ApiError::unprocessable(message),
            Error::QuotaExceeded(message) => {
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "quota_exceeded", message)
            }
            Error::SteerQueueFull(message) => {
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "steer_queue_full", message)
            }
            other => ApiError::internal(&other),
        }
    }
}

impl From<ratchet_engine::Error> for ApiError {
    fn from(error: ratchet_engine::Error) -> ApiError {
        match error {
            ratchet_engine::Error::Store(store) => store.into(),
            ratchet_engine::Error::Invalid(message) => ApiError::bad_request(message),
            other => ApiError::internal(&other),
        }
    }
}

/// Answers 413 at once to a request whose `Content-Length` is over the body limit, instead of
/// reading (or waiting for) a body that would be refused anyway.
pub(crate) async fn refuse_oversized_bodies(request: Request, next: Next) -> Response {
    let declared = request
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
    match declared {
        Some(length) if length > crate::api::MAX_BODY_BYTES as u64 => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!(
                "the body is {length} bytes; the most accepted is {}",
                crate::api::MAX_BODY_BYTES
            ),
        )
        .into_response(),
        _ => next.run(request).await,
    }
}

/// The request's head and its whole body, read within the body limit.
async fn body_bytes<S: Send + Sync>(
    request: Request,
    state: &S,
) -> Result<(axum::http::request::Parts, Bytes), ApiError> {
    let (head, body) = request.into_parts();
    let bytes = Bytes::from_request(Request::from_parts(head.clone(), body), state)
        .await
        .map_err(|rejection| {
            let status = rejection.status();
            ApiError::new(status, code_for(status), rejection.body_text())
        })?;
    Ok((head, bytes))
}

fn code_for(status: StatusCode) -> &'static str {
    match status {
        StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
        StatusCode::UNPROCESSABLE_ENTITY => "invalid_request",
        _ => "bad_request",
    }
}

/// `axum::Json` whose rejections are API errors: malformed JSON 400, wrong types or unknown
/// fields 422, a body that is not a JSON object 422, a missing JSON content type 415, an
/// oversized body 413.
pub struct ApiJson<T>(pub T);

impl<T, S> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        let (head, bytes) = body_bytes(request, state).await?;
        // serde reads a struct from a JSON array too (its fields in order): `[null, null]`
        // would create a session. Every body is an object.
        let object = bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
        let request = Request::from_parts(head, Body::from(bytes));
        match <axum::Json<T> as FromRequest<S>>::from_request(request, state).await {
            Ok(_) if !object => Err(ApiError::unprocessable(
                "invalid request body: expected a JSON object, found an array",
            )),
            Ok(axum::Json(value)) => Ok(ApiJson(value)),
            Err(rejection) => {
                let status = rejection.status();
                let message = match &rejection {
                    JsonRejection::JsonDataError(e) => {
                        format!("invalid request body: {}", error_source(e))
                    }
                    JsonRejection::JsonSyntaxError(e) => {
                        format!("malformed JSON: {}", error_source(e))
                    }
                    _ => rejection.body_text(),
                };
                Err(ApiError::new(status, code_for(status), message))
            }
        }
    }
}

/// An optional body (`Option<ApiJson<T>>`): none when the request has no body at all, and
/// otherwise read exactly as `ApiJson` reads one, so a body sent without its JSON content type
/// is refused rather than ignored.
impl<T, S> OptionalFromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Option<Self>, ApiError> {
        let (head, bytes) = body_bytes(request, state).await?;
        if bytes.is_empty() {
            return Ok(None);
        }
        let request = Request::from_parts(head, Body::from(bytes));
        <ApiJson<T> as FromRequest<S>>::from_request(request, state)
            .await
            .map(Some)
    }
}

/// The innermost message of an extractor error (serde's own words, with line and column).
fn error_source(error: &dyn std::error::Error) -> String {
    let mut inner = error;
    while let Some(source) = inner.source() {
        inner = source;
    }
    inner.to_string()
}

/// `axum::extract::Query` whose rejections are 400 API errors.
pub struct ApiQuery<T>(pub T);

impl<T, S> FromRequestParts<S> for ApiQuery<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(ApiQuery(value)),
            Err(rejection) => {
                let message = match &rejection {
                    QueryRejection::FailedToDeserializeQueryString(e) => {
                        format!("invalid query string: {}", error_source(e))
                    }
                    other => other.body_text(),
                };
                Err(ApiError::bad_request(message))
            }
        }
    }
}

pub async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::not_found(format!("no route for {}", uri.path()))
}

pub async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{method} is not allowed on {}", uri.path()),
    )
}

/// A handler panicked: the client gets a plain 500, never the panic's text.
pub fn panicked(panic: Box<dyn Any + Send + 'static>) -> Response {
    let message = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("unknown panic");
    ApiError::internal(&format!("handler panicked: {message}")).into_response()
}

/// `axum::extract::Path` whose rejections are 400 API errors.
pub struct ApiPath<T>(pub T);

impl<T, S> FromRequestParts<S> for ApiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Path(value)| ApiPath(value))
            .map_err(|rejection| ApiError::bad_request(rejection.body_text()))
    }
}
