//! Which MCP servers a process uses: a plain serde type (unknown keys are errors, so a typo
//! never silently falls back to a default) and the checks that run before anything starts.
//!
//! It reads no file: whoever owns the configuration file deserializes this part of it and
//! hands it over. The environment is read for one thing only, header values given as
//! `{ env = "VARIABLE" }`, when the servers are checked, so a secret need not be in the file.

use std::collections::BTreeMap;
use std::time::Duration;

use ratchet_core::{ApprovalPolicy, ReplayPolicy};
use reqwest::header::{HeaderName, HeaderValue};
use serde::Deserialize;

use crate::Error;

/// How long a call may take when a server sets no `timeout_ms`.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// How long starting a server (spawn or connect, handshake, tool listing) may take when it
/// sets no `startup_timeout_ms`.
pub const DEFAULT_STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

/// The MCP servers whose tools a runtime offers, by name (`[mcp.servers.NAME]`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub servers: BTreeMap<String, ServerConfig>,
}

/// One server: a command to start (stdio) or a URL to reach (streamable HTTP).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Program to start; it speaks MCP on its stdin and stdout.
    pub command: Option<String>,
    #[serde(default)]
    pub args: Vec<String>,
    /// Variables set for the command, on top of a minimal inherited environment
    /// (`HOME`, `LOGNAME`, `PATH`, `SHELL`, `TERM`, `USER`, `LANG`, `TMPDIR`): the rest of
    /// this process's environment, API keys included, is not passed on.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Streamable HTTP endpoint, `http://` or `https://`.
    pub url: Option<String>,
    /// Headers sent with every HTTP request (an `Authorization` header, for instance).
    #[serde(default)]
    pub headers: BTreeMap<String, HeaderSource>,
    /// How long one call may take before it is an error outcome (default 60 s).
    pub timeout_ms: Option<u64>,
    /// How long starting the server and listing its tools may take (default 30 s).
    pub startup_timeout_ms: Option<u64>,
    /// Replay policy of this server's tools (default `never`: an outside effect whose outcome
    /// is unknown after a crash waits for a human). `keyed` suits servers that deduplicate
    /// by the idempotency key sent in each call's `_meta`.
    pub replay: Option<ReplayPolicy>,
    /// Whether calls of this server's tools wait for a human (default `always`).
    pub approval: Option<Approval>,
}

/// Where a header's value comes from: the configuration itself (`"Bearer …"`), or an
/// environment variable read when the servers are checked (`{ env = "SEARCH_TOKEN" }`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderSource {
    Value(String),
    Env(String),
}

impl From<&str> for HeaderSource {
    fn from(value: &str) -> HeaderSource {
        HeaderSource::Value(value.to_owned())
    }
}

impl From<String> for HeaderSource {
    fn from(value: String) -> HeaderSource {
        HeaderSource::Value(value)
    }
}

impl<'de> Deserialize<'de> for HeaderSource {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Source;
        impl<'de> serde::de::Visitor<'de> for Source {
            type Value = HeaderSource;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string, or { env = \"VARIABLE\" }")
            }

            fn visit_str<E: serde::de::Error>(self, value: &str) -> Result<HeaderSource, E> {
                Ok(HeaderSource::Value(value.to_owned()))
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<HeaderSource, A::Error> {
                let mut variable = None;
                while let Some(key) = map.next_key::<String>()? {
                    if key != "env" || variable.is_some() {
                        return Err(serde::de::Error::custom(format!(
                            "unexpected key `{key}`: expected a string, or {{ env = \"VARIABLE\" }}"
                        )));
                    }
                    variable = Some(map.next_value::<String>()?);
                }
                variable
                    .map(HeaderSource::Env)
                    .ok_or_else(|| serde::de::Error::missing_field("env"))
            }
        }
        deserializer.deserialize_any(Source)
    }
}

/// A server-wide approval default; per-tool rules with argument globs belong to the
/// configuration of each tool (`[tools."server.tool"]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Approval {
    Always,
    Never,
}

/// Headers the streamable HTTP transport sets itself (lowercase, as `HeaderName` keeps them).
const RESERVED_HEADERS: &[&str] = &[
    "accept",
    "mcp-session-id",
    "mcp-protocol-version",
    "last-event-id",
];

/// How a server is reached, once checked.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Transport {
    Stdio {
        command: String,
        args: Vec<String>,
        env: BTreeMap<String, String>,
    },
    Http {
        url: String,
        headers: Vec<(HeaderName, HeaderValue)>,
    },
}

/// A server's checked configuration.
#[derive(Debug, Clone)]
pub(crate) struct Checked {
    pub name: String,
    pub transport: Transport,
    pub call_timeout: Duration,
    pub startup_timeout: Duration,
    pub replay: ReplayPolicy,
    pub approval: ApprovalPolicy,
}

impl Config {
    /// Checks every server; the first problem found is the error, naming the server and the
    /// key at fault.
    pub fn validate(&self) -> Result<(), Error> {
        self.checked().map(|_| ())
    }

    /// Checks every server, reading header values from this process's environment.
    pub(crate) fn checked(&self) -> Result<Vec<Checked>, Error> {
        self.checked_with(&|variable| std::env::var(variable).ok())
    }

    pub(crate) fn checked_with(
        &self,
        environment: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Vec<Checked>, Error> {
        self.servers
            .iter()
            .map(|(name, server)| {
                server.checked(name, environment).map_err(|reason| {
                    Error::Config(format!("mcp.servers.{}: {reason}", printable(name)))
                })
            })
            .collect()
    }
}

impl ServerConfig {
    fn checked(
        &self,
        name: &str,
        environment: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Checked, String> {
        check_name(name)?;
        let transport = match (&self.command, &self.url) {
            (Some(command), None) => {
                if command.trim().is_empty() {
                    return Err("`command` is empty".into());
                }
                if !self.headers.is_empty() {
                    return Err("`headers` apply to a `url` server, not to a `command`".into());
                }
                for key in self.env.keys() {
                    if key.is_empty() || key.contains(['=', '\0']) {
                        return Err(format!("`env` has an invalid variable name {key:?}"));
                    }
                }
                Transport::Stdio {
                    command: command.clone(),
                    args: self.args.clone(),
                    env: self.env.clone(),
                }
            }
            (None, Some(url)) => {
                if !self.args.is_empty() || !self.env.is_empty() {
                    return Err(
                        "`args` and `env` apply to a `command` server, not to a `url`".into(),
                    );
                }
                let parsed = reqwest::Url::parse(url)
                    .map_err(|e| format!("`url` {url:?} is not a valid URL: {e}"))?;
                if !matches!(parsed.scheme(), "http" | "https") {
                    return Err(format!("`url` {url:?} must start with http:// or https://"));
                }
                let mut headers = Vec::with_capacity(self.headers.len());
                for (key, value) in &self.headers {
                    let name = HeaderName::from_bytes(key.as_bytes())
                        .map_err(|_| format!("`headers` has an invalid header name {key:?}"))?;
                    if RESERVED_HEADERS.contains(&name.as_str()) {
                        return Err(format!(
                            "`headers.{key}` is set by the MCP transport itself"
                        ));
                    }
                    let value = match value {
                        HeaderSource::Value(value) => HeaderValue::from_str(value)
                            .map_err(|_| format!("`headers.{key}` is not a valid header value"))?,
                        HeaderSource::Env(variable) => {
                            let value = environment(variable).ok_or_else(|| {
                                format!(
                                    "`headers.{key}` is read from the environment variable \
                                     {variable:?}, which is not set"
                                )
                            })?;
                            // The value is a secret: the message names where it came from only.
                            HeaderValue::from_str(&value).map_err(|_| {
                                format!(
                                    "`headers.{key}`: the environment variable {variable:?} \
                                     does not hold a valid header value"
                                )
                            })?
                        }
                    };
                    headers.push((name, value));
                }
                Transport::Http {
                    url: url.clone(),
                    headers,
                }
            }
            (Some(_), Some(_)) => {
                return Err(
                    "give exactly one of `command` (stdio) or `url` (HTTP), not both".into(),
                );
            }
            (None, None) => {
                return Err("give exactly one of `command` (stdio) or `url` (HTTP)".into());
            }
        };
        let millis = |key: &str, value: Option<u64>, default: Duration| match value {
            Some(0) => Err(format!("`{key}` must be at least 1")),
            Some(ms) => Ok(Duration::from_millis(ms)),
            None => Ok(default),
        };
        Ok(Checked {
            name: name.to_owned(),
            transport,
            call_timeout: millis("timeout_ms", self.timeout_ms, DEFAULT_CALL_TIMEOUT)?,
            startup_timeout: millis(
                "startup_timeout_ms",
                self.startup_timeout_ms,
                DEFAULT_STARTUP_TIMEOUT,
            )?,
            replay: self.replay.unwrap_or(ReplayPolicy::Never),
            approval: match self.approval.unwrap_or(Approval::Always) {
                Approval::Always => ApprovalPolicy::Always,
                Approval::Never => ApprovalPolicy::Never,
            },
        })
    }
}

/// Server names become the prefix of tool names (`name.tool`): `[a-z][a-z0-9_-]{0,31}`.
fn check_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_lowercase());
    let rest_ok =
        chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-');
    if first_ok && rest_ok && name.len() <= 32 {
        Ok(())
    } else {
        Err(
            "invalid server name: expected a lowercase letter, then up to 31 lowercase letters, \
             digits, `_` or `-`"
                .into(),
        )
    }
}

/// A name as it may be quoted in a message: TOML keys can hold anything.
fn printable(name: &str) -> String {
    if !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        name.to_owned()
    } else {
        format!("{name:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, String> {
        toml::from_str::<Config>(text).map_err(|e| e.to_string())
    }

    fn error(text: &str) -> String {
        match parse(text) {
            Err(e) => e,
            Ok(config) => config.validate().unwrap_err().to_string(),
        }
    }

    #[test]
    fn both_transports_with_their_defaults_and_overrides() {
        let config = parse(
            r#"
            [servers.files]
            command = "npx"
            args = ["-y", "server-filesystem", "/data"]
            env = { LOG_LEVEL = "debug" }
            timeout_ms = 5000

            [servers.search]
            url = "https://mcp.example.com/mcp"
            headers = { Authorization = "Bearer secret" }
            startup_timeout_ms = 2000
            replay = "keyed"
            approval = "never"
            "#,
        )
        .unwrap();
        let checked = config.checked().unwrap();
        let (files, search) = (&checked[0], &checked[1]);
        assert_eq!(files.name, "files");
        assert_eq!(
            files.transport,
            Transport::Stdio {
                command: "npx".into(),
                args: vec!["-y".into(), "server-filesystem".into(), "/data".into()],
                env: [("LOG_LEVEL".to_owned(), "debug".to_owned())].into(),
            }
        );
        assert_eq!(files.call_timeout, Duration::from_millis(5000));
        assert_eq!(files.startup_timeout, DEFAULT_STARTUP_TIMEOUT);
        assert_eq!(files.replay, ReplayPolicy::Never);
        assert_eq!(files.approval, ApprovalPolicy::Always);
        let Transport::Http { url, headers } = &search.transport else {
            panic!("search is an HTTP server");
        };
        assert_eq!(url, "https://mcp.example.com/mcp");
        assert_eq!(headers[0].0, "authorization");
        assert_eq!(headers[0].1, "Bearer secret");
        assert_eq!(search.call_timeout, DEFAULT_CALL_TIMEOUT);
        assert_eq!(search.startup_timeout, Duration::from_millis(2000));
        assert_eq!(search.replay, ReplayPolicy::Keyed);
        assert_eq!(search.approval, ApprovalPolicy::Never);
        assert!(parse("").unwrap().checked().unwrap().is_empty());
    }

    #[test]
    fn a_header_value_may_come_from_the_environment() {
        let config = parse(
            r#"
            [servers.search]
            url = "https://mcp.example.com/mcp"
            headers = { Authorization = { env = "SEARCH_TOKEN" }, X-Team = "core" }
            "#,
        )
        .unwrap();
        assert_eq!(
            config.servers["search"].headers["Authorization"],
            HeaderSource::Env("SEARCH_TOKEN".into())
        );
        let environment = |variable: &str| {
            (variable == "SEARCH_TOKEN").then(|| "Bearer from-the-environment".to_owned())
        };
        let checked = config.checked_with(&environment).unwrap();
        let Transport::Http { headers, .. } = &checked[0].transport else {
            panic!("search is an HTTP server");
        };
        let headers: Vec<(&str, &str)> = (headers.iter())
            .map(|(name, value)| (name.as_str(), value.to_str().unwrap()))
            .collect();
        assert_eq!(
            headers,
            [
                ("authorization", "Bearer from-the-environment"),
                ("x-team", "core")
            ]
        );

        let missing = config.checked_with(&|_| None).unwrap_err().to_string();
        assert_eq!(
            missing,
            "invalid MCP configuration: mcp.servers.search: `headers.Authorization` is read from \
             the environment variable \"SEARCH_TOKEN\", which is not set"
        );
        let invalid = config
            .checked_with(&|_| Some("line\nbreak SECRET".into()))
            .unwrap_err()
            .to_string();
        assert_eq!(
            invalid,
            "invalid MCP configuration: mcp.servers.search: `headers.Authorization`: the \
             environment variable \"SEARCH_TOKEN\" does not hold a valid header value"
        );
        for (text, expected) in [
            (
                "headers = { A = { file = \"x\" } }",
                "unexpected key `file`: expected a string, or { env = \"VARIABLE\" }",
            ),
            ("headers = { A = {} }", "missing field `env`"),
            (
                "headers = { A = 7 }",
                "expected a string, or { env = \"VARIABLE\" }",
            ),
            ("headers = { A = { env = 7 } }", "expected a string"),
        ] {
            let error = error(&format!("[servers.a]\nurl = \"http://h\"\n{text}"));
            assert!(error.contains(expected), "{text:?}: {error}");
        }
    }

    #[test]
    fn every_mistake_is_named_with_its_server_and_key() {
        let cases = [
            (
                "[servers.a]\ncommand = \"x\"\nurl = \"http://h\"",
                "mcp.servers.a: give exactly one of `command` (stdio) or `url` (HTTP), not both",
            ),
            (
                "[servers.a]\nargs = [\"x\"]",
                "mcp.servers.a: give exactly one of `command` (stdio) or `url` (HTTP)",
            ),
            ("[servers.a]\ncommand = \" \"", "`command` is empty"),
            (
                "[servers.a]\ncommand = \"x\"\nheaders = { A = \"b\" }",
                "`headers` apply to a `url` server",
            ),
            (
                "[servers.a]\nurl = \"http://h\"\nargs = [\"x\"]",
                "`args` and `env` apply to a `command` server",
            ),
            (
                "[servers.a]\nurl = \"ftp://h\"",
                "must start with http:// or https://",
            ),
            ("[servers.a]\nurl = \"not a url\"", "is not a valid URL"),
            (
                "[servers.a]\nurl = \"http://h\"\nheaders = { \"bad name\" = \"x\" }",
                "invalid header name \"bad name\"",
            ),
            (
                "[servers.a]\nurl = \"http://h\"\nheaders = { A = \"line\\nbreak\" }",
                "`headers.A` is not a valid header value",
            ),
            (
                "[servers.a]\nurl = \"http://h\"\nheaders = { Mcp-Session-Id = \"x\" }",
                "`headers.Mcp-Session-Id` is set by the MCP transport itself",
            ),
            (
                "[servers.a]\ncommand = \"x\"\nenv = { \"A=B\" = \"c\" }",
                "invalid variable name \"A=B\"",
            ),
            (
                "[servers.a]\ncommand = \"x\"\ntimeout_ms = 0",
                "mcp.servers.a: `timeout_ms` must be at least 1",
            ),
            (
                "[servers.a]\ncommand = \"x\"\nstartup_timeout_ms = 0",
                "`startup_timeout_ms` must be at least 1",
            ),
            (
                "[servers.Files]\ncommand = \"x\"",
                "mcp.servers.Files: invalid server name",
            ),
            ("[servers.1x]\ncommand = \"x\"", "invalid server name"),
            (
                "[servers.\"a.b\"]\ncommand = \"x\"",
                "mcp.servers.\"a.b\": invalid server name",
            ),
            (
                &format!("[servers.{}]\ncommand = \"x\"", "a".repeat(33)),
                "invalid server name",
            ),
            (
                "[servers.a]\ncommand = \"x\"\ntimeout = 5",
                "unknown field `timeout`",
            ),
            (
                "[servers.a]\ncommand = \"x\"\napproval = \"sometimes\"",
                "unknown variant `sometimes`",
            ),
            (
                "[servers.a]\ncommand = \"x\"\nreplay = \"twice\"",
                "unknown variant `twice`",
            ),
            ("[server.a]\ncommand = \"x\"", "unknown field `server`"),
        ];
        for (text, expected) in cases {
            let error = error(text);
            assert!(error.contains(expected), "{text:?}: {error}");
        }
        // The longest name allowed, and every character class it may use.
        let ok = format!("[servers.{}]\ncommand = \"x\"", "a".repeat(32));
        assert!(parse(&ok).unwrap().validate().is_ok());
        assert!(
            parse("[servers.a_b-9]\ncommand = \"x\"")
                .unwrap()
                .validate()
                .is_ok()
        );
    }
}
