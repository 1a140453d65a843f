//! What the providers share on the wire: one HTTP client per model with the settings'
//! timeouts, a request whose failures are sorted into retryable and fatal ones, and an
//! answer read (whole, or event by event) that gives way at once to a cancellation.
//!
//! Nothing here retries. The engine does, durably and with backoff; a provider only says
//! whether trying again may help (`Error::Transient`, with the provider's `Retry-After`) or
//! not (`Error::Fatal`, with the provider's own message).

use std::collections::VecDeque;
use std::time::{Duration, SystemTime};

use ratchet_core::ModelSettings;
use reqwest::StatusCode;
use reqwest::header::HeaderMap;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::sse::{SseEvent, SseParser};
use crate::wire::preview;
use crate::{Error, Result};

/// The most of an error body read for its message.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// The client one model instance keeps for all its calls: `connect_timeout_ms` bounds
/// connecting, `read_timeout_ms` any silence while waiting for the answer's head or for its
/// next bytes (so a stream that stalls fails, however long a healthy one runs). A timeout of
/// zero means none.
pub(crate) fn client(settings: &ModelSettings) -> Result<reqwest::Client> {
    let mut builder =
        reqwest::Client::builder().user_agent(concat!("ratchet/", env!("CARGO_PKG_VERSION")));
    if settings.connect_timeout_ms > 0 {
        builder = builder.connect_timeout(Duration::from_millis(settings.connect_timeout_ms));
    }
    if settings.read_timeout_ms > 0 {
        builder = builder.read_timeout(Duration::from_millis(settings.read_timeout_ms));
    }
    builder.build().map_err(|e| Error::Spec {
        spec: format!("{}:{}", settings.provider, settings.model),
        reason: format!("cannot build the HTTP client: {}", chain(&e)),
    })
}

/// `base_url` and `path` joined by exactly one slash.
pub(crate) fn endpoint(base_url: &str, path: &str) -> String {
    format!("{}/{}", base_url.trim_end_matches('/'), path)
}

/// Sends the request and returns the response once its status is a success. Any other status
/// is an error: 408, 429 and 5xx transient (with the provider's wait, if it gave one), every
/// other one fatal, with the message of the provider's error body.
pub(crate) async fn send(
    request: reqwest::RequestBuilder,
    cancel: &CancellationToken,
) -> Result<reqwest::Response> {
    let response = tokio::select! {
        biased;
        () = cancel.cancelled() => return Err(Error::Cancelled),
        response = request.send() => response.map_err(|e| request_error(&e))?,
    };
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let retry_after = retry_after(response.headers(), SystemTime::now());
    let body = read_error_body(response, cancel).await?;
    Err(status_error(status, retry_after, &body))
}

/// Reads a whole successful answer.
pub(crate) async fn read_body(
    mut response: reqwest::Response,
    cancel: &CancellationToken,
) -> Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let chunk = tokio::select! {
            biased;
            () = cancel.cancelled() => return Err(Error::Cancelled),
            chunk = response.chunk() => chunk,
        };
        match chunk {
            Ok(Some(bytes)) => body.extend_from_slice(&bytes),
            Ok(None) => return Ok(body),
            Err(e) => return Err(body_error("the answer broke off", &e)),
        }
    }
}

/// Whether the answer is a JSON document rather than the event stream that was asked for
/// (some servers ignore `stream: true`).
pub(crate) fn is_json(response: &reqwest::Response) -> bool {
    response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("application/json"))
}

/// A streamed answer, read as server-sent events. Dropping it closes the stream.
pub(crate) struct Events {
    response: reqwest::Response,
    parser: SseParser,
    ready: VecDeque<SseEvent>,
}

impl Events {
    pub(crate) fn new(response: reqwest::Response) -> Events {
        Events {
            response,
            parser: SseParser::default(),
            ready: VecDeque::new(),
        }
    }

    /// The next event; `None` when the stream has ended. A stream that breaks or stays silent
    /// longer than the read timeout is a transient error.
    pub(crate) async fn next(&mut self, cancel: &CancellationToken) -> Result<Option<SseEvent>> {
        loop {
            if let Some(event) = self.ready.pop_front() {
                return Ok(Some(event));
            }
            let chunk = tokio::select! {
                biased;
                () = cancel.cancelled() => return Err(Error::Cancelled),
                chunk = self.response.chunk() => chunk,
            };
            match chunk {
                Ok(Some(bytes)) => self.ready.extend(self.parser.feed(&bytes)),
                Ok(None) => return Ok(None),
                Err(e) => return Err(body_error("the stream broke off", &e)),
            }
        }
    }
}

async fn read_error_body(
    mut response: reqwest::Response,
    cancel: &CancellationToken,
) -> Result<Vec<u8>> {
    let mut body = Vec::new();
    while body.len() < MAX_ERROR_BODY {
        let chunk = tokio::select! {
            biased;
            () = cancel.cancelled() => return Err(Error::Cancelled),
            chunk = response.chunk() => chunk,
        };
        match chunk {
            Ok(Some(bytes)) => body.extend_from_slice(&bytes),
            // What arrived is enough to report: the status decides what happens next.
            Ok(None) | Err(_) => break,
        }
    }
    Ok(body)
}

/// The error an unsuccessful status stands for.
pub(crate) fn status_error(
    status: StatusCode,
    retry_after: Option<Duration>,
    body: &[u8],
) -> Error {
    let mut message = match status.canonical_reason() {
        Some(reason) => format!("HTTP {} {reason}", status.as_u16()),
        None => format!("HTTP {}", status.as_u16()),
    };
    if let Some(said) = error_message(body) {
        message = format!("{message}: {said}");
    }
    let retryable = status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
        || status.is_server_error();
    if retryable {
        Error::Transient {
            message,
            retry_after,
        }
    } else {
        Error::Fatal(message)
    }
}

/// The provider's own words in an error body: `error.message` (with `error.type` before it
/// when given, as Anthropic and OpenAI do), `error` as a plain string (Ollama), a top-level
/// `message` (vLLM) or `detail`; else the body's text itself.
pub(crate) fn error_message(body: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if text.is_empty() {
        return None;
    }
    let Ok(json) = serde_json::from_str::<Value>(text) else {
        return Some(preview(text));
    };
    Some(api_error_message(&json).unwrap_or_else(|| preview(text)))
}

/// The message of a JSON error document (see [`error_message`]).
pub(crate) fn api_error_message(json: &Value) -> Option<String> {
    let error = json.get("error").unwrap_or(json);
    if let Some(text) = error.as_str() {
        return Some(text.to_owned());
    }
    let message = (error.get("message").or_else(|| error.get("detail")))
        .and_then(Value::as_str)
        .filter(|m| !m.is_empty())?;
    match error.get("type").and_then(Value::as_str) {
        Some(kind) if !kind.is_empty() && kind != "error" => Some(format!("{kind}: {message}")),
        _ => Some(message.to_owned()),
    }
}

/// An error the provider reported inside a successful answer (an `error` event or chunk,
/// after HTTP 200). Retryable when it says what a retryable status would: overloaded, rate
/// limited, or an error of the provider's own (Anthropic's `overloaded_error`,
/// `rate_limit_error` and `api_error`; OpenAI-compatible servers' `server_error` or a numeric
/// code of 429 or 5xx); anything else is fatal.
pub(crate) fn in_band_error(json: &Value) -> Error {
    let error = json.get("error").unwrap_or(json);
    let message = api_error_message(json).unwrap_or_else(|| preview(&json.to_string()));
    let message = format!("the provider reported an error: {message}");
    let retryable_kind = |field: &str| {
        error
            .get(field)
            .and_then(Value::as_str)
            .is_some_and(|kind| {
                matches!(
                    kind,
                    "overloaded_error"
                        | "rate_limit_error"
                        | "api_error"
                        | "server_error"
                        | "rate_limit_exceeded"
                )
            })
    };
    let retryable_code = ["code", "status"].iter().any(|field| {
        let code = error.get(*field).and_then(|c| match c {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => s.parse().ok(),
            _ => None,
        });
        code.is_some_and(|c| c == 408 || c == 429 || (500..600).contains(&c))
    });
    if retryable_kind("type") || retryable_kind("code") || retryable_code {
        Error::transient(message)
    } else {
        Error::Fatal(message)
    }
}

/// How long the provider asked to wait before trying again: `retry-after-ms` (milliseconds,
/// sent by OpenAI), else `Retry-After` as seconds or as an HTTP date (a date in the past means
/// now).
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    if let Some(ms) = header("retry-after-ms").and_then(|v| v.parse::<f64>().ok())
        && ms.is_finite()
        && ms >= 0.0
    {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    let value = header("retry-after")?;
    if let Ok(seconds) = value.parse::<f64>() {
        return (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

/// A request that got no answer: a refused connection or a timeout may pass; a request that
/// could not even be built (a malformed URL) will not.
fn request_error(e: &reqwest::Error) -> Error {
    let what = if e.is_builder() {
        return Error::Fatal(format!("cannot make the request: {}", chain(e)));
    } else if e.is_connect() {
        "cannot connect"
    } else if e.is_timeout() {
        "no answer in time"
    } else {
        "the request failed"
    };
    Error::transient(format!("{what}: {}", chain(e)))
}

fn body_error(what: &str, e: &reqwest::Error) -> Error {
    let what = if e.is_timeout() {
        "no data in time (read timeout)"
    } else {
        what
    };
    Error::transient(format!("{what}: {}", chain(e)))
}

/// An error with its causes, which is where reqwest keeps the useful part ("connection
/// refused").
fn chain(e: &dyn std::error::Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut source = e.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if parts.last() != Some(&text) {
            parts.push(text);
        }
        source = cause.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use reqwest::header::HeaderValue;
    use serde_json::json;

    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.insert(*name, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    #[test]
    fn retry_after_in_seconds_milliseconds_or_an_http_date() {
        let now = httpdate::parse_http_date("Wed, 21 Oct 2015 07:28:00 GMT").unwrap();
        let wait = |pairs: &[(&'static str, &str)]| retry_after(&headers(pairs), now);
        assert_eq!(wait(&[("retry-after", "7")]), Some(Duration::from_secs(7)));
        assert_eq!(wait(&[("retry-after", " 0 ")]), Some(Duration::ZERO));
        assert_eq!(
            wait(&[("retry-after", "1.5")]),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(
            wait(&[("retry-after", "Wed, 21 Oct 2015 07:28:30 GMT")]),
            Some(Duration::from_secs(30))
        );
        // The obsolete date formats HTTP still allows.
        assert_eq!(
            wait(&[("retry-after", "Wednesday, 21-Oct-15 07:29:00 GMT")]),
            Some(Duration::from_secs(60))
        );
        assert_eq!(
            wait(&[("retry-after", "Wed, 21 Oct 2015 07:27:00 GMT")]),
            Some(Duration::ZERO),
            "a date in the past"
        );
        // Milliseconds win over seconds.
        assert_eq!(
            wait(&[("retry-after-ms", "250"), ("retry-after", "9")]),
            Some(Duration::from_millis(250))
        );
        assert_eq!(
            wait(&[("retry-after-ms", "x"), ("retry-after", "9")]),
            Some(Duration::from_secs(9))
        );
        assert_eq!(wait(&[("retry-after", "soon")]), None);
        assert_eq!(wait(&[("retry-after", "-3")]), None);
        assert_eq!(wait(&[]), None);
    }

    #[test]
    fn error_messages_in_the_shapes_providers_send() {
        let message = |body: &str| error_message(body.as_bytes());
        assert_eq!(
            message(
                r#"{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: too big"}}"#
            ),
            Some("invalid_request_error: max_tokens: too big".into())
        );
        assert_eq!(
            message(
                r#"{"error":{"message":"Incorrect API key","type":"invalid_request_error","code":"invalid_api_key"}}"#
            ),
            Some("invalid_request_error: Incorrect API key".into())
        );
        assert_eq!(
            message(r#"{"error":{"message":"bad","type":null}}"#),
            Some("bad".into())
        );
        assert_eq!(
            message(r#"{"error":"model 'x' not found"}"#),
            Some("model 'x' not found".into())
        );
        assert_eq!(
            message(r#"{"object":"error","message":"too long","type":"BadRequestError"}"#),
            Some("BadRequestError: too long".into())
        );
        assert_eq!(
            message(r#"{"detail":"Not Found"}"#),
            Some("Not Found".into())
        );
        assert_eq!(
            message("<html>bad gateway</html>"),
            Some("<html>bad gateway</html>".into())
        );
        assert_eq!(
            message(r#"{"unexpected":true}"#),
            Some(r#"{"unexpected":true}"#.into())
        );
        assert_eq!(message("  "), None);
    }

    #[test]
    fn statuses_sort_into_transient_and_fatal() {
        let wait = Some(Duration::from_secs(2));
        for code in [408, 429, 500, 502, 503, 529] {
            let status = StatusCode::from_u16(code).unwrap();
            assert!(
                matches!(status_error(status, wait, b""), Error::Transient { retry_after, .. } if retry_after == wait),
                "{code}"
            );
        }
        for code in [400, 401, 403, 404, 413, 422] {
            let status = StatusCode::from_u16(code).unwrap();
            assert!(
                matches!(status_error(status, wait, b""), Error::Fatal(_)),
                "{code}"
            );
        }
        assert_eq!(
            status_error(
                StatusCode::BAD_REQUEST,
                None,
                br#"{"error":{"message":"no"}}"#
            ),
            Error::Fatal("HTTP 400 Bad Request: no".into())
        );
    }

    #[test]
    fn errors_inside_an_answer_sort_by_what_they_say() {
        let transient = [
            json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
            json!({"type": "error", "error": {"type": "api_error", "message": "Internal"}}),
            json!({"error": {"message": "Provider disconnected", "code": "server_error"}}),
            json!({"error": {"message": "slow down", "code": 429}}),
            json!({"error": {"message": "upstream", "code": "502"}}),
        ];
        for error in transient {
            assert!(
                matches!(in_band_error(&error), Error::Transient { .. }),
                "{error}"
            );
        }
        assert_eq!(
            in_band_error(
                &json!({"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long"}})
            ),
            Error::Fatal(
                "the provider reported an error: invalid_request_error: prompt is too long".into()
            )
        );
        assert!(matches!(
            in_band_error(&json!({"error": {"message": "bad", "code": 400}})),
            Error::Fatal(_)
        ));
    }

    #[test]
    fn endpoints_join_with_one_slash() {
        assert_eq!(
            endpoint("http://h/v1", "chat/completions"),
            "http://h/v1/chat/completions"
        );
        assert_eq!(
            endpoint("http://h/v1/", "chat/completions"),
            "http://h/v1/chat/completions"
        );
    }
}
