//! Bearer tokens and tenants. Tokens are kept only as SHA-256 hashes; each belongs to one
//! tenant, and a request sees only its tenant's sessions, runs and events — another tenant's
//! ids answer 404, as if they did not exist.

use std::collections::{HashMap, HashSet};

use axum::extract::FromRequestParts;
use axum::http::StatusCode;
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
    /// Hashes of the tokens that may also administer the server.
    admin_hashes: HashSet<String>,
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
        Tokens {
            tenants_by_hash,
            admin_hashes: HashSet::new(),
        }
    }

    /// The same tokens, where those hashed as `hashes` may also administer the server.
    pub fn with_admins(mut self, hashes: impl IntoIterator<Item = String>) -> Tokens {
        self.admin_hashes.extend(hashes);
        self
    }

    pub fn is_empty(&self) -> bool {
        self.tenants_by_hash.is_empty()
    }

    /// Who a request bearing `token` acts for; None for a token not accepted.
    pub fn caller(&self, token: &str) -> Option<Caller> {
        let hash = hash_token(token);
        let tenant = self.tenants_by_hash.get(&hash)?;
        Some(Caller {
            tenant: tenant.clone(),
            admin: self.admin_hashes.contains(&hash),
        })
    }
}

/// Who a request acts for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub tenant: String,
    /// May also administer the server (`POST /v1/admin/reload`).
    pub admin: bool,
}

/// The tenant a request acts for.
pub struct Tenant(pub String);

/// A request whose token may administer the server (`[[tokens]] admin = true`). Without
/// authentication (a server that listens on loopback only) every request may.
pub struct Admin;

impl FromRequestParts<AppState> for Tenant {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Tenant, ApiError> {
        Ok(Tenant(authenticate(parts, state).await?.tenant))
    }
}

impl FromRequestParts<AppState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Admin, ApiError> {
        if authenticate(parts, state).await?.admin {
            Ok(Admin)
        } else {
            Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                "this token may not administer the server; give it `admin = true` in its \
                 [[tokens]] entry",
            ))
        }
    }
}

async fn authenticate(parts: &mut Parts, state: &AppState) -> Result<Caller, ApiError> {
    let Ok(Current(active)) = Current::from_request_parts(parts, state).await;
    let tokens = active.tokens();
    if tokens.is_empty() {
        return Ok(Caller {
            tenant: DEFAULT_TENANT.to_owned(),
            admin: true,
        });
    }
    let mut headers = parts.headers.get_all(AUTHORIZATION).iter();
    let token = match (headers.next(), headers.next()) {
        (Some(_), Some(_)) => {
            // A proxy that reads the last one would disagree with a server that reads the
            // first: neither may decide.
            return Err(ApiError::bad_request(
                "expected one Authorization header, found several",
            ));
        }
        (Some(value), None) => bearer_token(value.to_str().unwrap_or_default())?,
        // Browsers' EventSource cannot set headers: event streams, and only they (a
        // token in a URL ends up in logs), also take it from the query string.
        (None, _) => parts
            .uri
            .path()
            .ends_with("/events")
            .then(|| access_token_param(&parts.uri))
            .flatten()
            .filter(|token| !token.is_empty())
            .ok_or_else(|| ApiError::unauthorized("missing bearer token"))?,
    };
    tokens
        .caller(&token)
        .ok_or_else(|| ApiError::unauthorized("unknown bearer token"))
}

/// The token of `Bearer <token>`: the scheme in any case (RFC 9110), one space, and a token
/// with no whitespace of its own, so that two spellings never name one token.
fn bearer_token(value: &str) -> Result<String, ApiError> {
    let malformed = || {
        ApiError::unauthorized(
            "expected `Authorization: Bearer <token>`, with one space and no other whitespace",
        )
    };
    let (scheme, token) = value.split_once(' ').ok_or_else(malformed)?;
    if !scheme.eq_ignore_ascii_case("bearer")
        || token.is_empty()
        || token.chars().any(char::is_whitespace)
    {
        return Err(malformed());
    }
    Ok(token.to_owned())
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
        let tokens = Tokens::new(HashMap::from([(hash_token("secret"), "acme".to_owned())]))
            .with_admins([hash_token("secret")]);
        let caller = tokens.caller("secret").unwrap();
        assert_eq!((caller.tenant.as_str(), caller.admin), ("acme", true));
        assert!(tokens.caller("Secret").is_none());
    }

    #[test]
    fn a_bearer_token_has_one_spelling() {
        for accepted in ["Bearer t0k", "bearer t0k", "BEARER t0k"] {
            assert_eq!(
                bearer_token(accepted).ok().as_deref(),
                Some("t0k"),
                "{accepted}"
            );
        }
        for refused in [
            "Bearer  t0k",
            "Bearer t0k ",
            "Bearer\tt0k",
            "Bearer t\t0k",
            "Bearer ",
            "Bearer",
            "t0k",
            "Basic t0k",
        ] {
            assert!(bearer_token(refused).is_err(), "{refused:?} was accepted");
        }
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
