//! SQLite adapter of the `Store` port: one file, WAL, `synchronous=FULL` by default.
//!
//! One writer thread owns the only write connection and group-commits (see `writer`); reads
//! use their own connections. Every write transaction starts with `BEGIN IMMEDIATE`, so a
//! second process on the same file waits on `busy_timeout` instead of failing.

mod ops;
mod schema;
mod search;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use ratchet_core::step::{Reconciliation, Resumption};
use ratchet_core::{
    AgentState, ApprovalAnswer, ApprovalId, EventDraft, Message, Millis, RunConfigSnapshot, RunId,
    SessionId, StepRecord, StepResult, ToolOutcome,
};
use ratchet_store::{
    Answered, Approval, ApprovalStatus, CancelOutcome, Claim, ClaimedStep, Commit, Error, Intent,
    IntentRecord, Lease, MessageHit, NewRun, Reconciled, RecordedIntents, RunSummary, SearchScope,
    Session, SessionSpec, Store, StoreStats, StoredEvent, StoredMessage, Submitted,
};
use rusqlite::{Connection, OpenFlags};

use writer::{Readers, Writer};

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn backend(error: rusqlite::Error) -> Error {
    Error::Backend(error.to_string())
}

/// How hard each commit is pushed to disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// fsync on every commit: a committed step survives power loss (the default).
    Full,
    /// fsync at WAL checkpoints only: survives a process crash, not a power loss.
    Normal,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqliteOptions {
    pub path: PathBuf,
    pub durability: Durability,
}

impl SqliteOptions {
    /// Parses `sqlite://PATH` or `sqlite:PATH`, with an optional `?synchronous=full|normal`.
    pub fn from_url(url: &str) -> Result<SqliteOptions> {
        let bad = |reason: &str| Error::BadUrl {
            url: url.to_owned(),
            reason: reason.to_owned(),
        };
        let rest = url
            .strip_prefix("sqlite://")
            .or_else(|| url.strip_prefix("sqlite:"))
            .ok_or_else(|| bad("expected a url starting with sqlite://"))?;
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        if path.is_empty() || path == ":memory:" {
            return Err(bad(
                "expected a file path (an in-memory database cannot be shared by connections)",
            ));
        }
        let mut durability = Durability::Full;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            durability = match pair {
                "synchronous=full" => Durability::Full,
                "synchronous=normal" => Durability::Normal,
                other => {
                    return Err(bad(&format!(
                        "unknown option {other:?}; expected synchronous=full or synchronous=normal"
                    )));
                }
            };
        }
        Ok(SqliteOptions {
            path: PathBuf::from(path),
            durability,
        })
    }
}

/// The disk's own limit for durable writes, measured the way a commit is made durable here:
/// a fresh file in `dir`, WAL, `synchronous=FULL`, `count` single-row transactions one after
/// another (one fsync each). Returns the commits per second.
pub fn single_commit_rate(dir: &Path, count: u32) -> Result<f64> {
    let path = dir.join("commit-probe.db");
    let conn = Connection::open(&path).map_err(backend)?;
    conn.pragma_update(None, "journal_mode", "WAL")
        .and_then(|()| conn.pragma_update(None, "synchronous", "FULL"))
        .and_then(|()| conn.execute_batch("CREATE TABLE probe (n INTEGER NOT NULL)"))
        .map_err(backend)?;
    let started = std::time::Instant::now();
    for n in 0..count {
        conn.execute_batch("BEGIN IMMEDIATE")
            .and_then(|()| conn.execute("INSERT INTO probe (n) VALUES (?1)", [n]))
            .and_then(|_| conn.execute_batch("COMMIT"))
            .map_err(backend)?;
    }
    Ok(f64::from(count) / started.elapsed().as_secs_f64())
}

pub(crate) fn open_connection(path: &Path, read_only: bool) -> Result<Connection> {
    let flags = if read_only {
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX
    } else {
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
    };
    let conn = Connection::open_with_flags(path, flags)
        .map_err(|e| Error::Backend(format!("cannot open {}: {e}", path.display())))?;
    conn.busy_timeout(std::time::Duration::from_secs(10))
        .map_err(backend)?;
    conn.set_prepared_statement_cache_capacity(64);
    Ok(conn)
}

/// A connection as the store's operations see it, with the cache of run configurations.
pub(crate) struct Tx<'a> {
    pub(crate) conn: &'a Connection,
    pub(crate) configs: &'a Configs,
}

impl std::ops::Deref for Tx<'_> {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        self.conn
    }
}

/// Most run configurations kept parsed; past this the cache starts over.
const MAX_CACHED_CONFIGS: usize = 4096;

/// Parsed run configurations by run. A configuration never changes after its run is
/// created, so a cached copy is never stale, whichever process wrote the run; caching spares
/// every claim and commit from parsing the tool schemas again.
#[derive(Default)]
pub(crate) struct Configs {
    by_run: std::sync::Mutex<std::collections::HashMap<RunId, Arc<RunConfigSnapshot>>>,
}

impl Configs {
    pub(crate) fn get_or_load(
        &self,
        run_id: &RunId,
        load: impl FnOnce() -> Result<RunConfigSnapshot>,
    ) -> Result<Arc<RunConfigSnapshot>> {
        if let Some(config) = self.by_run.lock().ok().and_then(|m| m.get(run_id).cloned()) {
            return Ok(config);
        }
        let config = Arc::new(load()?);
        if let Ok(mut by_run) = self.by_run.lock() {
            if by_run.len() >= MAX_CACHED_CONFIGS {
                by_run.clear();
            }
            by_run.insert(run_id.clone(), Arc::clone(&config));
        }
        Ok(config)
    }

    /// Drops the entry of a run that has ended; it will not be claimed again.
    pub(crate) fn forget(&self, run_id: &RunId) {
        if let Ok(mut by_run) = self.by_run.lock() {
            by_run.remove(run_id);
        }
    }
}

pub struct SqliteStore {
    writer: Writer,
    readers: Arc<Readers>,
}

impl SqliteStore {
    pub fn open_url(url: &str) -> Result<SqliteStore> {
        SqliteStore::open(SqliteOptions::from_url(url)?)
    }

    pub fn open(options: SqliteOptions) -> Result<SqliteStore> {
        if let Some(parent) = options.path.parent().filter(|p| !p.as_os_str().is_empty())
            && !parent.is_dir()
        {
            return Err(Error::BadUrl {
                url: options.path.display().to_string(),
                reason: format!("directory {} does not exist", parent.display()),
            });
        }
        let mut conn = open_connection(&options.path, false)?;
        let journal: String = conn
            .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
            .map_err(backend)?;
        if !journal.eq_ignore_ascii_case("wal") {
            return Err(Error::Backend(format!(
                "expected WAL journal mode, SQLite chose {journal}"
            )));
        }
        let synchronous = match options.durability {
            Durability::Full => "FULL",
            Durability::Normal => "NORMAL",
        };
        conn.pragma_update(None, "synchronous", synchronous)
            .map_err(backend)?;
        conn.pragma_update(None, "foreign_keys", "ON")
            .map_err(backend)?;
        // Each group-committed operation runs in a savepoint; its statement journal stays
        // in memory instead of a temporary file.
        conn.pragma_update(None, "temp_store", "MEMORY")
            .map_err(backend)?;
        conn.pragma_update(None, "cache_size", -65_536)
            .map_err(backend)?;
        schema::migrate(&mut conn)?;
        let configs = Arc::new(Configs::default());
        let writer = Writer::spawn(conn, Arc::clone(&configs))
            .map_err(|e| Error::Backend(format!("cannot start writer thread: {e}")))?;
        Ok(SqliteStore {
            writer,
            readers: Readers::new(options.path, configs),
        })
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn create_session(
        &self,
        id: &SessionId,
        spec: SessionSpec,
        now: Millis,
    ) -> Result<Session> {
        let id = id.clone();
        self.writer
            .write(move |c| ops::create_session(c, &id, spec, now))
            .await
    }

    async fn get_session(&self, id: &SessionId) -> Result<Session> {
        let id = id.clone();
        self.readers.read(move |c| ops::get_session(c, &id)).await
    }

    async fn list_sessions(
        &self,
        tenant: &str,
        after: Option<&SessionId>,
        limit: u32,
    ) -> Result<Vec<Session>> {
        let (tenant, after) = (tenant.to_owned(), after.cloned());
        self.readers
            .read(move |c| ops::list_sessions(c, &tenant, after.as_ref(), limit))
            .await
    }

    async fn visible_messages(
        &self,
        session_id: &SessionId,
        after_position: i64,
        limit: u32,
    ) -> Result<Vec<StoredMessage>> {
        let session_id = session_id.clone();
        self.readers
            .read(move |c| ops::visible_messages(c, &session_id, after_position, limit))
            .await
    }

    async fn search_messages(
        &self,
        scope: SearchScope,
        query: &str,
        limit: u32,
    ) -> Result<Vec<MessageHit>> {
        let query = query.to_owned();
        self.writer.write(search::catch_up).await?;
        self.readers
            .read(move |c| search::search_messages(c, &scope, &query, limit))
            .await
    }

    async fn session_runs(
        &self,
        session_id: &SessionId,
        after: Option<&RunId>,
        limit: u32,
    ) -> Result<Vec<RunSummary>> {
        let (session_id, after) = (session_id.clone(), after.cloned());
        self.readers
            .read(move |c| ops::session_runs(c, &session_id, after.as_ref(), limit))
            .await
    }

    async fn run_events_after(
        &self,
        run_id: &RunId,
        after_seq: i64,
        limit: u32,
    ) -> Result<Vec<StoredEvent>> {
        let run_id = run_id.clone();
        self.readers
            .read(move |c| ops::run_events_after(c, &run_id, after_seq, limit))
            .await
    }

    async fn submit_message(&self, new: NewRun, now: Millis) -> Result<Submitted> {
        self.writer
            .write(move |c| ops::submit_message(c, new, now))
            .await
    }

    async fn claim_next(
        &self,
        lease: Lease,
        run: Option<&RunId>,
        now: Millis,
    ) -> Result<Option<ClaimedStep>> {
        let run = run.cloned();
        self.writer
            .write(move |c| ops::claim_next(c, &lease, run.as_ref(), now))
            .await
    }

    async fn heartbeat(&self, claim: &Claim, expires_at: Millis) -> Result<bool> {
        let claim = claim.clone();
        self.writer
            .write(move |c| ops::heartbeat(c, &claim, expires_at))
            .await
    }

    async fn commit_step(
        &self,
        claim: &Claim,
        result: StepResult,
        continue_with: Option<Lease>,
        now: Millis,
    ) -> Result<Commit> {
        let claim = claim.clone();
        self.writer
            .write(move |c| ops::commit_step(c, &claim, result, continue_with, now))
            .await
    }

    async fn retry_later(
        &self,
        claim: &Claim,
        available_at: Millis,
        event: EventDraft,
        now: Millis,
    ) -> Result<Option<Vec<StoredEvent>>> {
        let claim = claim.clone();
        self.writer
            .write(move |c| ops::retry_later(c, &claim, available_at, event, now))
            .await
    }

    async fn append_events(
        &self,
        session_id: &SessionId,
        run_id: &RunId,
        events: Vec<EventDraft>,
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        let (session_id, run_id) = (session_id.clone(), run_id.clone());
        self.writer
            .write(move |c| ops::insert_events(c, &session_id, Some(&run_id), &events, now))
            .await
    }

    async fn record_intents(
        &self,
        claim: &Claim,
        intents: Vec<Intent>,
        events: Vec<EventDraft>,
        now: Millis,
    ) -> Result<RecordedIntents> {
        let claim = claim.clone();
        self.writer
            .write(move |c| ops::record_intents(c, &claim, &intents, &events, now))
            .await
    }

    async fn record_outcome(
        &self,
        claim: &Claim,
        slot: u32,
        outcome: ToolOutcome,
        now: Millis,
    ) -> Result<()> {
        let claim = claim.clone();
        self.writer
            .write(move |c| ops::record_outcome(c, &claim, slot, &outcome, now))
            .await
    }

    async fn intents(&self, run_id: &RunId, step_index: u64) -> Result<Vec<IntentRecord>> {
        let run_id = run_id.clone();
        self.readers
            .read(move |c| ops::intents(c, &run_id, step_index))
            .await
    }

    async fn request_cancel(&self, run_id: &RunId, now: Millis) -> Result<CancelOutcome> {
        let run_id = run_id.clone();
        self.writer
            .write(move |c| ops::request_cancel(c, &run_id, now))
            .await
    }

    async fn reconcile(
        &self,
        run_id: &RunId,
        call_id: &str,
        answer: Reconciliation,
        result: Option<String>,
        now: Millis,
    ) -> Result<Reconciled> {
        let (run_id, call_id) = (run_id.clone(), call_id.to_owned());
        self.writer
            .write(move |c| ops::reconcile(c, &run_id, &call_id, answer, result, now))
            .await
    }

    async fn resume_failed(
        &self,
        run_id: &RunId,
        how: Resumption,
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        let run_id = run_id.clone();
        self.writer
            .write(move |c| ops::resume_failed(c, &run_id, how, now))
            .await
    }

    async fn approvals(
        &self,
        tenant: &str,
        status: Option<ApprovalStatus>,
        after: Option<&ApprovalId>,
        limit: u32,
    ) -> Result<Vec<Approval>> {
        let (tenant, after) = (tenant.to_owned(), after.cloned());
        self.readers
            .read(move |c| ops::approvals(c, &tenant, status, after.as_ref(), limit))
            .await
    }

    async fn get_approval(&self, id: &ApprovalId) -> Result<Approval> {
        let id = id.clone();
        self.readers.read(move |c| ops::get_approval(c, &id)).await
    }

    async fn answer_approval(
        &self,
        id: &ApprovalId,
        answer: ApprovalAnswer,
        now: Millis,
    ) -> Result<Answered> {
        let id = id.clone();
        self.writer
            .write(move |c| ops::answer_approval(c, &id, answer, now))
            .await
    }

    async fn load_state(&self, run_id: &RunId) -> Result<AgentState> {
        let run_id = run_id.clone();
        self.readers
            .read(move |c| ops::load_state(c, &run_id))
            .await
    }

    async fn context(&self, session_id: &SessionId) -> Result<Vec<StoredMessage>> {
        let session_id = session_id.clone();
        self.readers
            .read(move |c| ops::context(c, &session_id))
            .await
    }

    async fn history(&self, session_id: &SessionId) -> Result<Vec<Message>> {
        let session_id = session_id.clone();
        self.readers
            .read(move |c| ops::history(c, &session_id))
            .await
    }

    async fn list_runs(&self) -> Result<Vec<RunSummary>> {
        self.readers.read(ops::list_runs).await
    }

    async fn steps(&self, run_id: &RunId) -> Result<Vec<StepRecord>> {
        let run_id = run_id.clone();
        self.readers.read(move |c| ops::steps(c, &run_id)).await
    }

    async fn events_after(
        &self,
        session_id: &SessionId,
        after_seq: i64,
        limit: u32,
    ) -> Result<Vec<StoredEvent>> {
        let session_id = session_id.clone();
        self.readers
            .read(move |c| ops::events_after(c, &session_id, after_seq, limit))
            .await
    }

    async fn lease_owners(&self) -> Result<Vec<String>> {
        self.readers.read(ops::lease_owners).await
    }

    async fn release_leases(&self, owner: &str) -> Result<u64> {
        let owner = owner.to_owned();
        self.writer
            .write(move |c| ops::release_leases(c, &owner))
            .await
    }

    async fn stats(&self, now: Millis) -> Result<StoreStats> {
        self.readers.read(move |c| ops::stats(c, now)).await
    }

    async fn runs_with_jobs(&self) -> Result<Vec<RunId>> {
        self.readers.read(ops::runs_with_jobs).await
    }
}
