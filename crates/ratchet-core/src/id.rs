//! Typed, prefixed identifiers (`ses_…`, `run_…`, `msg_…`, `apr_…`, `whk_…`, `sch_…`).
//!
//! The core cannot generate ids (that needs randomness or a clock); it only defines their
//! shape and validates them at the edges.

use std::fmt;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid {kind} id {found:?}: expected `{prefix}` followed by 1-{max_len} letters, digits or '-'"
)]
pub struct IdError {
    pub kind: &'static str,
    pub prefix: &'static str,
    pub max_len: usize,
    pub found: String,
}

macro_rules! typed_id {
    ($name:ident, $prefix:literal, $kind:literal, $max_len:literal) => {
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            pub const PREFIX: &'static str = $prefix;
            /// The most characters after the prefix.
            pub const MAX_SUFFIX_LEN: usize = $max_len;

            /// Builds an id from a caller-supplied unique suffix (for example a UUIDv7).
            pub fn from_suffix(suffix: &str) -> Result<Self, IdError> {
                Self::parse(&format!("{}{}", $prefix, suffix))
            }

            pub fn parse(text: &str) -> Result<Self, IdError> {
                let suffix = text.strip_prefix($prefix).unwrap_or("");
                let valid = !suffix.is_empty()
                    && suffix.len() <= $max_len
                    && suffix
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '-');
                if valid {
                    Ok(Self(text.to_owned()))
                } else {
                    Err(IdError {
                        kind: $kind,
                        prefix: $prefix,
                        max_len: $max_len,
                        found: text.to_owned(),
                    })
                }
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(value: String) -> Result<Self, IdError> {
                Self::parse(&value)
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }
    };
}

typed_id!(SessionId, "ses_", "session", 64);
typed_id!(RunId, "run_", "run", 64);
typed_id!(MessageId, "msg_", "message", 64);
// An approval is named after its run and step: room for a run's suffix, '-' and a step.
typed_id!(ApprovalId, "apr_", "approval", 85);
typed_id!(WebhookId, "whk_", "webhook", 64);
typed_id!(ScheduleId, "sch_", "schedule", 64);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_keep_their_prefix_and_reject_others() {
        let run = RunId::from_suffix("0192-abc").unwrap();
        assert_eq!(run.as_str(), "run_0192-abc");
        assert_eq!(RunId::parse("run_0192-abc").unwrap(), run);
        let err = RunId::parse("ses_0192").unwrap_err();
        assert_eq!(err.kind, "run");
        assert!(err.to_string().contains("expected `run_`"), "{err}");
        assert!(RunId::parse("run_").is_err());
        assert!(RunId::parse("run_a b").is_err());
        assert!(SessionId::parse(&format!("ses_{}", "x".repeat(65))).is_err());
    }

    #[test]
    fn ids_round_trip_through_json_and_reject_bad_ones() {
        let id = SessionId::from_suffix("abc").unwrap();
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, "\"ses_abc\"");
        assert_eq!(serde_json::from_str::<SessionId>(&json).unwrap(), id);
        assert!(serde_json::from_str::<SessionId>("\"run_abc\"").is_err());
    }
}
