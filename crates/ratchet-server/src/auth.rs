//! Bearer tokens and tenants. Tokens are kept only as SHA-256 hashes; each belongs to one
//! tenant, and a request sees only its tenant's sessions, runs and events — another tenant's
//! ids answer 404, as if they did not exist.

use std::collections::HashMap;

use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use ratchet_store::DEFAULT_TENANT;
use sha2::{Digest, Sha256};

use crate::active::Current;
use crate::{ApiError, AppState};

/// The accepted tokens, by hash. Empty means authentication is off: every request belongs to
/// the default tenant.
#[derive(Debug, Default, Clone)]
pub struct Tokens {
    tenants_by_hash: HashMap<String, String>,
}

/// Lowercase hex SHA-256 of a token, as configured in `[[tokens]] sha256 = …`.
pub fn hash_token(token: &str) -> String {
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl Tokens {
    pub fn new(tenants_by_hash: HashMap<String, String>) -> Tokens {
        Tokens { tenants_by_hash }
    }

    pub fn is_empty(&self) -> bool {
        self.tenants_by_hash.is_empty()
    }

    fn tenant_of(&self, token: &str) -> Option<&str> {
        self.tenants_by_hash
            .get(&hash_token(token))
            .map(String::as_str)
    }
}

/// The tenant a request acts for.
pub struct Tenant(pub String);

impl FromRequestParts<AppState> for Tenant {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Tenant, ApiError> {
        let Ok(Current(active)) = Current::from_request_parts(parts, state).await;
        let tokens = active.tokens();
        if tokens.is_empty() {
            return Ok(Tenant(DEFAULT_TENANT.to_owned()));
        }
        let token = match parts.headers.get(AUTHORIZATION) {
            Some(value) => {
                let value = value.to_str().unwrap_or_default();
                value
                    .strip_prefix("Bearer ")
                    .map(str::trim)
                    .ok_or_else(|| {
                        ApiError::unauthorized("expected `Authorization: Bearer <token>`")
                    })?
                    .to_owned()
            }
            // Browsers' EventSource cannot set headers: event streams, and only they (a
            // token in a URL ends up in logs), also take it from the query string.
            None => parts
                .uri
                .path()
                .ends_with("/events")
                .then(|| access_token_param(&parts.uri))
                .flatten()
                .ok_or_else(|| ApiError::unauthorized("missing bearer token"))?,
        };
        tokens
            .tenant_of(&token)
            .map(|tenant| Tenant(tenant.to_owned()))
            .ok_or_else(|| ApiError::unauthorized("unknown bearer token"))
    }
}

/// `?access_token=`, percent-decoded: a token with `+`, `/` or `=` (base64) arrives encoded.
fn access_token_param(uri: &axum::http::Uri) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Param {
        access_token: Option<String>,
    }
    axum::extract::Query::<Param>::try_from_uri(uri)
        .ok()?
        .0
        .access_token
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_matched_by_hash() {
        assert_eq!(
            hash_token("secret"),
            "2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b"
        );
        let tokens = Tokens::new(HashMap::from([(hash_token("secret"), "acme".to_owned())]));
        assert_eq!(tokens.tenant_of("secret"), Some("acme"));
        assert_eq!(tokens.tenant_of("Secret"), None);
    }

    #[test]
    fn the_query_token_is_found_among_other_parameters() {
        let param = |uri: &str| access_token_param(&uri.parse().unwrap());
        assert_eq!(param("/e?after=3&access_token=t0k"), Some("t0k".into()));
        assert_eq!(
            param("/e?access_token=a%2Bb%2F%3D%3D"),
            Some("a+b/==".into())
        );
        assert_eq!(param("/e?after=3"), None);
        assert_eq!(param("/e"), None);
    }
}
