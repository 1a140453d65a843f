//! Which names a request may address the server by. A page on another site whose name is made
//! to resolve to this machine (DNS rebinding) reaches the server with its own name in `Host`
//! and `Origin`; without this check, a server without tokens on loopback would obey it. So a
//! request must name the server by an address it listens on, `localhost` when it listens on
//! loopback, or a name of `[server] allowed_hosts`; a browser's `Origin`, when sent, must
//! name one of the same.

use std::net::{IpAddr, SocketAddr};

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::http::header::{HOST, ORIGIN};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::{ApiError, AppState};

/// The names a server answers to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPolicy {
    listen: IpAddr,
    /// Exact names and `*.suffix` patterns, lowercase.
    allowed: Vec<String>,
    /// `allowed_hosts = ["*"]`: the operator checks names elsewhere (a proxy).
    any: bool,
}

impl Default for HostPolicy {
    /// A server listening on loopback, with no other names.
    fn default() -> HostPolicy {
        HostPolicy {
            listen: IpAddr::from([127, 0, 0, 1]),
            allowed: Vec::new(),
            any: false,
        }
    }
}

impl HostPolicy {
    /// The names a server listening on `listen` answers to, with `allowed_hosts` besides.
    /// An entry that is not a host name or `*.` pattern is refused with the reason.
    pub fn new(listen: SocketAddr, allowed_hosts: &[String]) -> Result<HostPolicy, String> {
        let mut allowed = Vec::new();
        let mut any = false;
        for entry in allowed_hosts {
            let name = entry.trim().to_ascii_lowercase();
            if name == "*" {
                any = true;
                continue;
            }
            let bare = name.strip_prefix("*.").unwrap_or(&name);
            let valid = !bare.is_empty()
                && bare
                    .split('.')
                    .all(|label| !label.is_empty() && label.chars().all(is_name_char));
            if !valid {
                return Err(format!(
                    "server.allowed_hosts: expected a host name (`ratchet.example.com`), a \
                     pattern (`*.example.com`) or `*`, found {entry:?}"
                ));
            }
            allowed.push(name);
        }
        Ok(HostPolicy {
            listen: listen.ip(),
            allowed,
            any,
        })
    }

    /// Whether a request may name the server `host` (no port, IPv6 without brackets).
    fn admits(&self, host: &str) -> bool {
        if self.any {
            return true;
        }
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        if let Ok(ip) = host.parse::<IpAddr>() {
            // An address is never a name another site controls; only one this server is not
            // reachable at is a mistake.
            return self.listen.is_unspecified()
                || ip == self.listen
                || (ip.is_loopback() && self.listen.is_loopback());
        }
        if host == "localhost" || host.ends_with(".localhost") {
            return self.listen.is_loopback() || self.listen.is_unspecified();
        }
        self.allowed
            .iter()
            .any(|pattern| match pattern.strip_prefix("*.") {
                Some(suffix) => host
                    .strip_suffix(suffix)
                    .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
                None => *pattern == host,
            })
    }

    /// What the server answers to, for error messages.
    fn describe(&self) -> String {
        let mut names = vec![self.listen.to_string()];
        if self.listen.is_loopback() || self.listen.is_unspecified() {
            names.push("localhost".to_owned());
        }
        names.extend(self.allowed.iter().cloned());
        names.join(", ")
    }
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

/// The host of an authority (`name:port`, `[::1]:port`, `name`).
fn host_of(authority: &str) -> &str {
    if let Some(rest) = authority.strip_prefix('[') {
        return rest.split(']').next().unwrap_or_default();
    }
    authority
        .rsplit_once(':')
        .map_or(authority, |(host, _)| host)
}

/// Refuses a request that names the server by a name it does not answer to: 421 for `Host`,
/// 403 for `Origin`. A request with no `Host` (HTTP/1.0, a test's own request) comes from no
/// browser and passes.
pub(crate) async fn check(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let policy = &state.hosts;
    let host = request
        .uri()
        .authority()
        .map(|authority| authority.as_str().to_owned())
        .or_else(|| {
            let value = request.headers().get(HOST)?;
            Some(value.to_str().unwrap_or("\u{fffd}").to_owned())
        });
    if let Some(host) = host
        && !policy.admits(host_of(&host))
    {
        return ApiError::new(
            StatusCode::MISDIRECTED_REQUEST,
            "misdirected_request",
            format!(
                "this server does not answer to the host {host:?}; it answers to {}. Add the \
                 name to [server] allowed_hosts if it is this server's",
                policy.describe()
            ),
        )
        .into_response();
    }
    if let Some(origin) = request.headers().get(ORIGIN) {
        let origin = origin.to_str().unwrap_or("\u{fffd}");
        let admitted = origin
            .split_once("://")
            .filter(|(scheme, _)| matches!(*scheme, "http" | "https"))
            .is_some_and(|(_, authority)| policy.admits(host_of(authority)));
        if !admitted {
            return ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden_origin",
                format!(
                    "requests from pages of {origin:?} are refused; this server answers to {}. \
                     Add the name to [server] allowed_hosts if it is this server's",
                    policy.describe()
                ),
            )
            .into_response();
        }
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(listen: &str, allowed: &[&str]) -> HostPolicy {
        let allowed: Vec<String> = allowed.iter().map(|s| (*s).to_owned()).collect();
        HostPolicy::new(listen.parse().unwrap(), &allowed).unwrap()
    }

    #[test]
    fn a_loopback_server_answers_to_loopback_names_only() {
        let loopback = policy("127.0.0.1:7700", &[]);
        for host in [
            "127.0.0.1",
            "localhost",
            "LOCALHOST",
            "localhost.",
            "::1",
            "127.0.0.2",
        ] {
            assert!(loopback.admits(host), "{host}");
        }
        for host in [
            "attacker.example",
            "10.0.0.1",
            "localhost.attacker.example",
            "",
            "127.0.0.1.nip.io",
        ] {
            assert!(!loopback.admits(host), "{host}");
        }
    }

    #[test]
    fn allowed_hosts_add_names_and_patterns() {
        let public = policy("0.0.0.0:80", &["ratchet.example.com", "*.agents.example"]);
        for host in [
            "ratchet.example.com",
            "a.agents.example",
            "b.c.agents.example",
            "192.0.2.7",
            "localhost",
        ] {
            assert!(public.admits(host), "{host}");
        }
        for host in [
            "agents.example",
            "xagents.example",
            "example.com",
            "ratchet.example.com.evil",
        ] {
            assert!(!public.admits(host), "{host}");
        }
        assert!(policy("127.0.0.1:1", &["*"]).admits("anything.example"));
        for bad in ["", "a b", "http://x", "x:80", "*.", "a..b"] {
            assert!(
                HostPolicy::new("127.0.0.1:1".parse().unwrap(), &[bad.to_owned()]).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn the_host_is_read_from_an_authority() {
        assert_eq!(host_of("localhost:7700"), "localhost");
        assert_eq!(host_of("[::1]:7700"), "::1");
        assert_eq!(host_of("[::1]"), "::1");
        assert_eq!(host_of("example.com"), "example.com");
    }
}
