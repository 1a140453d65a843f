//! The connection as the transaction bodies see it: statements with numbered parameters
//! (`?1`, `?2`, …), rows of plain values, and the few things SQL dialects do differently.

use std::sync::Arc;

use ratchet_core::{RunConfigSnapshot, RunId};
use ratchet_store::Error;

use crate::Result;

/// A statement parameter, borrowed from the caller for the statement's duration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Param<'a> {
    Int(Option<i64>),
    Real(Option<f64>),
    Text(Option<&'a str>),
}

impl From<i64> for Param<'_> {
    fn from(value: i64) -> Self {
        Param::Int(Some(value))
    }
}

impl From<u32> for Param<'_> {
    fn from(value: u32) -> Self {
        Param::Int(Some(i64::from(value)))
    }
}

/// Flags are stored as 0 or 1 in every dialect.
impl From<bool> for Param<'_> {
    fn from(value: bool) -> Self {
        Param::Int(Some(i64::from(value)))
    }
}

impl From<Option<i64>> for Param<'_> {
    fn from(value: Option<i64>) -> Self {
        Param::Int(value)
    }
}

impl From<f64> for Param<'_> {
    fn from(value: f64) -> Self {
        Param::Real(Some(value))
    }
}

impl<'a> From<&'a str> for Param<'a> {
    fn from(value: &'a str) -> Self {
        Param::Text(Some(value))
    }
}

impl<'a> From<&'a String> for Param<'a> {
    fn from(value: &'a String) -> Self {
        Param::Text(Some(value))
    }
}

impl<'a> From<Option<&'a str>> for Param<'a> {
    fn from(value: Option<&'a str>) -> Self {
        Param::Text(value)
    }
}

impl<'a> From<&'a Option<String>> for Param<'a> {
    fn from(value: &'a Option<String>) -> Self {
        Param::Text(value.as_deref())
    }
}

/// A value kept to be bound later (a statement built as it goes), bound as it would read back.
impl<'a> From<&'a Value> for Param<'a> {
    fn from(value: &'a Value) -> Self {
        match value {
            Value::Null => Param::Text(None),
            Value::Int(value) => Param::Int(Some(*value)),
            Value::Real(value) => Param::Real(Some(*value)),
            Value::Text(value) => Param::Text(Some(value)),
        }
    }
}

/// The parameters of one statement: `params![a, b]` is `[Param::from(a), Param::from(b)]`.
#[macro_export]
macro_rules! params {
    ($($value:expr),* $(,)?) => {
        [$($crate::Param::from($value)),*]
    };
}

/// A column value as read.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Value {
    #[default]
    Null,
    Int(i64),
    Real(f64),
    Text(String),
}

/// One result row. Getters take the value out (a column is read once) and say which column
/// held what when it is not the expected kind.
#[derive(Debug, Clone, PartialEq)]
pub struct Row(Vec<Value>);

impl Row {
    pub fn new(values: Vec<Value>) -> Row {
        Row(values)
    }

    fn take(&mut self, column: usize) -> Result<Value> {
        let found = self.0.len();
        self.0
            .get_mut(column)
            .map(std::mem::take)
            .ok_or_else(|| Error::Backend(format!("expected column {column}, the row has {found}")))
    }

    pub fn opt_int(&mut self, column: usize) -> Result<Option<i64>> {
        match self.take(column)? {
            Value::Null => Ok(None),
            Value::Int(value) => Ok(Some(value)),
            other => Err(unexpected(column, "an integer", &other)),
        }
    }

    pub fn int(&mut self, column: usize) -> Result<i64> {
        self.opt_int(column)?
            .ok_or_else(|| unexpected(column, "an integer", &Value::Null))
    }

    pub fn flag(&mut self, column: usize) -> Result<bool> {
        Ok(self.int(column)? != 0)
    }

    pub fn real(&mut self, column: usize) -> Result<f64> {
        match self.take(column)? {
            Value::Real(value) => Ok(value),
            Value::Int(value) => Ok(value as f64),
            other => Err(unexpected(column, "a number", &other)),
        }
    }

    pub fn opt_text(&mut self, column: usize) -> Result<Option<String>> {
        match self.take(column)? {
            Value::Null => Ok(None),
            Value::Text(value) => Ok(Some(value)),
            other => Err(unexpected(column, "text", &other)),
        }
    }

    pub fn text(&mut self, column: usize) -> Result<String> {
        self.opt_text(column)?
            .ok_or_else(|| unexpected(column, "text", &Value::Null))
    }
}

fn unexpected(column: usize, expected: &str, found: &Value) -> Error {
    Error::Corrupt(format!(
        "expected {expected} in column {column}, found {found:?}"
    ))
}

/// What a transaction announces to other processes sharing the database when it commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Announcement<'a> {
    /// Jobs nobody holds were enqueued.
    JobsReady,
    /// Events `first_seq..=last_seq` were appended to the session.
    Events {
        session_id: &'a str,
        first_seq: i64,
        last_seq: i64,
    },
}

/// One open transaction (or, for reads, one connection). Statements use `?N` parameters;
/// an adapter rewrites them for its dialect.
pub trait Db {
    /// Runs a statement, returning how many rows it changed.
    fn execute(&self, sql: &str, params: &[Param<'_>]) -> Result<u64>;

    /// Runs a write whose row count the body does not need. An adapter may hold it back and
    /// send it with the next statement that answers (or the commit), saving a round trip;
    /// statements still run in the order they were issued, and if this one fails, the
    /// statement it went with fails, and so does the transaction.
    fn write(&self, sql: &str, params: &[Param<'_>]) -> Result<()> {
        self.execute(sql, params).map(|_| ())
    }

    /// Runs a query, returning every row.
    fn query(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>>;

    /// The first row of a query, if any.
    fn query_opt(&self, sql: &str, params: &[Param<'_>]) -> Result<Option<Row>> {
        Ok(self.query(sql, params)?.into_iter().next())
    }

    /// Holds the session's row until the transaction ends: every write that touches a
    /// session's runs, messages, events or jobs takes it first, so those writes are serial
    /// even across processes. A backend with one writer has nothing to do. The sessions of a
    /// delegation tree share one lock, their root session's: a child's end writes its parent
    /// and a parent's cancel writes its children, and one lock per tree cannot be taken in
    /// two orders.
    fn lock_session(&self, session_id: &str) -> Result<()>;

    /// `lock_session` of the session the run belongs to.
    fn lock_session_of_run(&self, run_id: &str) -> Result<()>;

    /// Holds the global run quota until the transaction ends, so that admissions to different
    /// trees count the unfinished runs one after another. Taken only after a session's lock,
    /// and no session is locked after it, so it cannot close a cycle. A backend with one
    /// writer has nothing to do.
    fn lock_run_quota(&self) -> Result<()>;

    /// What a claim appends to its `SELECT` so that concurrent claims pass over the rows
    /// others are taking instead of waiting for them ("" with one writer).
    fn skip_locked(&self) -> &'static str;

    /// What a read appends to its `SELECT` to hold the rows it read until the transaction
    /// ends, so that a write the body makes later on the strength of what it read still finds
    /// them so ("" with one writer).
    fn for_update(&self) -> &'static str;

    /// Tells other processes what this transaction did, once it commits (nothing with one
    /// process).
    fn announce(&self, announcement: Announcement<'_>) -> Result<()>;

    /// The process's cache of run configurations.
    fn configs(&self) -> &Configs;
}

/// Most run configurations kept parsed; past this the cache starts over.
const MAX_CACHED_CONFIGS: usize = 4096;

/// Parsed run configurations, by run and by stored configuration. A configuration never
/// changes after its run is created, so a cached copy is never stale, whichever process wrote
/// the run; caching spares every claim and commit from parsing the tool schemas again, and the
/// runs frozen with one configuration (an agent's) share one parsed copy.
#[derive(Default)]
pub struct Configs {
    by_run: std::sync::Mutex<std::collections::HashMap<RunId, Arc<RunConfigSnapshot>>>,
    by_id: std::sync::Mutex<std::collections::HashMap<String, Arc<RunConfigSnapshot>>>,
}

/// A run's stored configuration as read: its id in `run_configs` and its JSON.
pub(crate) struct StoredConfig {
    pub(crate) id: String,
    pub(crate) json: String,
}

/// Keeps `config` under `key`, starting the cache over once it holds `MAX_CACHED_CONFIGS`.
fn remember<K: std::hash::Hash + Eq>(
    cache: &std::sync::Mutex<std::collections::HashMap<K, Arc<RunConfigSnapshot>>>,
    key: K,
    config: &Arc<RunConfigSnapshot>,
) {
    if let Ok(mut cache) = cache.lock() {
        if cache.len() >= MAX_CACHED_CONFIGS {
            cache.clear();
        }
        cache.insert(key, Arc::clone(config));
    }
}

impl Configs {
    /// The run's configuration: cached, or read by `load` and parsed by `parse` unless a run
    /// with the same stored configuration was read before.
    pub(crate) fn get_or_load(
        &self,
        run_id: &RunId,
        load: impl FnOnce() -> Result<StoredConfig>,
        parse: impl FnOnce(&str) -> Result<RunConfigSnapshot>,
    ) -> Result<Arc<RunConfigSnapshot>> {
        if let Some(config) = self.by_run.lock().ok().and_then(|m| m.get(run_id).cloned()) {
            return Ok(config);
        }
        let stored = load()?;
        let known = self
            .by_id
            .lock()
            .ok()
            .and_then(|m| m.get(&stored.id).cloned());
        let config = match known {
            Some(config) => config,
            None => {
                let config = Arc::new(parse(&stored.json)?);
                remember(&self.by_id, stored.id, &config);
                config
            }
        };
        remember(&self.by_run, run_id.clone(), &config);
        Ok(config)
    }

    /// Drops the entry of a run that has ended; it will not be claimed again.
    pub fn forget(&self, run_id: &RunId) {
        if let Ok(mut by_run) = self.by_run.lock() {
            by_run.remove(run_id);
        }
    }
}
