//! What the transaction bodies share to read and write columns: values as JSON, enums by their
//! serde names, ids and run statuses parsed back (one that does not parse is `Error::Corrupt`),
//! the error of a run that is not there, and `count`.

use ratchet_core::{IdError, RunId, RunStatus, SessionId};
use ratchet_store::Error;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::Result;
use crate::db::Db;

pub(crate) fn to_json(value: &impl Serialize) -> Result<String> {
    serde_json::to_string(value).map_err(|e| Error::Corrupt(format!("cannot encode: {e}")))
}

pub(crate) fn from_json<T: DeserializeOwned>(text: &str, what: &str) -> Result<T> {
    serde_json::from_str(text).map_err(|e| Error::Corrupt(format!("{what}: {e}")))
}

/// Reads an enum stored as its serde name.
pub fn sql_enum<T: DeserializeOwned>(text: &str) -> Result<T> {
    from_json(&format!("\"{text}\""), "stored enum")
}

pub(crate) fn sql_str<T: Serialize>(value: &T) -> Result<String> {
    Ok(to_json(value)?.trim_matches('"').to_owned())
}

pub(crate) fn corrupt(error: IdError) -> Error {
    Error::Corrupt(error.to_string())
}

pub(crate) fn parse_run_id(text: &str) -> Result<RunId> {
    RunId::parse(text).map_err(corrupt)
}

pub(crate) fn parse_session_id(text: &str) -> Result<SessionId> {
    SessionId::parse(text).map_err(corrupt)
}

pub(crate) fn parse_status(text: &str) -> Result<RunStatus> {
    RunStatus::parse(text).ok_or_else(|| Error::Corrupt(format!("unknown status {text:?}")))
}

pub(crate) fn run_not_found(run_id: &RunId) -> Error {
    Error::NotFound {
        kind: "run",
        id: run_id.to_string(),
    }
}

pub(crate) fn count(c: &dyn Db, sql: &str, params: &[crate::db::Param<'_>]) -> Result<u64> {
    let n = c
        .query_opt(sql, params)?
        .ok_or_else(|| Error::Backend("a count returned no row".into()))?
        .int(0)?;
    Ok(n.max(0) as u64)
}
