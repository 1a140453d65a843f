//! The web console: a page and its script and styles, compiled into the binary and served at
//! `/`. It is a client of the public API like any other (it reads and acts through `/v1` and
//! the event streams with the token the person enters), so it needs no route of its own
//! beyond its files, and the files themselves need no token.

use std::sync::LazyLock;

use axum::Router;
use axum::http::header::{
    CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, ETAG, IF_NONE_MATCH, REFERRER_POLICY,
    X_CONTENT_TYPE_OPTIONS,
};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use sha2::{Digest, Sha256};

/// One file of the console, with the validator browsers revalidate it by.
struct Asset {
    body: &'static str,
    content_type: &'static str,
    etag: HeaderValue,
}

impl Asset {
    fn new(body: &'static str, content_type: &'static str) -> Asset {
        let digest = Sha256::digest(body.as_bytes());
        let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        Asset {
            body,
            content_type,
            etag: HeaderValue::from_str(&format!("\"{hex}\"")).expect("hex is a valid header"),
        }
    }

    fn respond(&self, request: &HeaderMap) -> Response {
        // No inline script or style anywhere, so the page can forbid both; it talks only to
        // this origin and may not be framed.
        let headers = [
            (CONTENT_TYPE, HeaderValue::from_static(self.content_type)),
            (CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            (ETAG, self.etag.clone()),
            (X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff")),
            (REFERRER_POLICY, HeaderValue::from_static("no-referrer")),
            (
                CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(
                    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                     img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
                ),
            ),
        ];
        if request.get(IF_NONE_MATCH) == Some(&self.etag) {
            return (StatusCode::NOT_MODIFIED, headers).into_response();
        }
        (headers, self.body).into_response()
    }
}

static PAGE: LazyLock<Asset> = LazyLock::new(|| {
    Asset::new(
        include_str!("../console/index.html"),
        "text/html; charset=utf-8",
    )
});
static SCRIPT: LazyLock<Asset> = LazyLock::new(|| {
    Asset::new(
        include_str!("../console/app.js"),
        "text/javascript; charset=utf-8",
    )
});
static STYLES: LazyLock<Asset> = LazyLock::new(|| {
    Asset::new(
        include_str!("../console/style.css"),
        "text/css; charset=utf-8",
    )
});

static ICON: LazyLock<Asset> =
    LazyLock::new(|| Asset::new(include_str!("../console/favicon.svg"), "image/svg+xml"));

pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(
            "/",
            get(|headers: HeaderMap| async move { PAGE.respond(&headers) }),
        )
        .route(
            "/console/app.js",
            get(|headers: HeaderMap| async move { SCRIPT.respond(&headers) }),
        )
        .route(
            "/console/style.css",
            get(|headers: HeaderMap| async move { STYLES.respond(&headers) }),
        )
        // Browsers ask for `/favicon.ico` whatever the page names.
        .route(
            "/console/favicon.svg",
            get(|headers: HeaderMap| async move { ICON.respond(&headers) }),
        )
        .route(
            "/favicon.ico",
            get(|headers: HeaderMap| async move { ICON.respond(&headers) }),
        )
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    use super::*;

    async fn get_with(path: &str, if_none_match: Option<&HeaderValue>) -> Response {
        let mut request = Request::get(path);
        if let Some(etag) = if_none_match {
            request = request.header(IF_NONE_MATCH, etag);
        }
        router::<()>()
            .oneshot(request.body(Body::empty()).unwrap())
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn every_file_is_served_with_its_type_and_a_strict_policy() {
        for (path, content_type, marker) in [
            ("/", "text/html; charset=utf-8", "<main"),
            (
                "/console/app.js",
                "text/javascript; charset=utf-8",
                "EventStream",
            ),
            (
                "/console/style.css",
                "text/css; charset=utf-8",
                ":focus-visible",
            ),
            ("/console/favicon.svg", "image/svg+xml", "<svg"),
            ("/favicon.ico", "image/svg+xml", "<svg"),
        ] {
            let response = get_with(path, None).await;
            assert_eq!(response.status(), StatusCode::OK, "{path}");
            assert_eq!(response.headers()[CONTENT_TYPE], content_type, "{path}");
            let policy = response.headers()[CONTENT_SECURITY_POLICY]
                .to_str()
                .unwrap();
            assert!(policy.contains("script-src 'self';"), "{path}: {policy}");
            assert!(!policy.contains("unsafe-inline"), "{path}: {policy}");
            let etag = response.headers()[ETAG].clone();
            let body = axum::body::to_bytes(response.into_body(), usize::MAX)
                .await
                .unwrap();
            assert!(
                String::from_utf8_lossy(&body).contains(marker),
                "{path} holds {marker:?}"
            );
            let again = get_with(path, Some(&etag)).await;
            assert_eq!(again.status(), StatusCode::NOT_MODIFIED, "{path}");
        }
    }

    #[test]
    fn the_page_loads_nothing_inline() {
        let page = include_str!("../console/index.html");
        assert!(!page.contains("<style"), "styles live in style.css");
        assert!(
            page.matches("<script").count() == 1
                && page.contains(r#"<script type="module" src="/console/app.js"></script>"#),
            "one script, from its own file"
        );
        let handlers = page
            .split(" on")
            .skip(1)
            .filter(|rest| {
                let name: String = rest.chars().take_while(char::is_ascii_lowercase).collect();
                !name.is_empty() && rest[name.len()..].starts_with('=')
            })
            .count();
        assert_eq!(handlers, 0, "no inline event handlers");
    }
}
