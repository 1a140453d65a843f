//! PostgreSQL adapter of the store: the transaction bodies of `ratchet-sql` run on a small
//! pool of synchronous connections, one transaction each, on tokio's blocking threads.
//!
//! Several processes may share one database. Writes to a session are serial because each
//! takes the session's row lock first (`Db::lock_session`); claims pass over the job rows
//! others are taking (`FOR UPDATE SKIP LOCKED`); each process hears what the others commit
//! through LISTEN/NOTIFY (`changes`). Nothing here ever retries a transaction: a body runs
//! once, and a conflict with another process is reported, not hidden.

mod changes;
mod db;
mod schema;
mod search;
#[cfg(feature = "testkit")]
pub mod testkit;

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use postgres::config::SslMode;
use postgres::error::SqlState;
use ratchet_sql::{Backend, Configs, Db, SqlStore};
use ratchet_store::{ChangeStream, Error, MessageHit, SearchScope};
use tokio::sync::Semaphore;

use db::{Access, Conn};

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Connections a backend opens when the url does not say (`pool=N`).
const DEFAULT_POOL: usize = 8;

/// How long opening a connection may take when the url does not say (`connect_timeout`).
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How to reach the database and how to use it.
#[derive(Debug, Clone)]
pub struct PgOptions {
    /// Where the server is and who connects (everything of the url but ratchet's options).
    pub config: postgres::Config,
    /// Most connections open at once for reads and writes; callers beyond wait for one. The
    /// follower of `changes` has a connection of its own.
    pub pool: usize,
    /// Bring the schema up to date when opening. When false, a schema behind this build makes
    /// opening fail (an operator runs `ratchet migrate` instead).
    pub migrate: bool,
}

impl PgOptions {
    /// Parses `postgres://user[:password]@host[:port]/database[?options]` (or
    /// `postgresql://`). Options are libpq's (`sslmode`, `connect_timeout`, …) and ratchet's
    /// own `pool=N`, which is taken out before the rest reaches the driver.
    pub fn from_url(url: &str) -> Result<PgOptions> {
        let bad = |reason: String| Error::BadUrl {
            url: redacted(url),
            reason,
        };
        if !url.starts_with("postgres://") && !url.starts_with("postgresql://") {
            return Err(bad(
                "expected a url starting with postgres:// or postgresql://".into(),
            ));
        }
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let mut pool = DEFAULT_POOL;
        let mut passed = Vec::new();
        for pair in query.split('&').filter(|pair| !pair.is_empty()) {
            match pair.split_once('=') {
                Some(("pool", count)) => {
                    pool = count.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                        bad(format!(
                            "pool={count}: expected a number of connections, at least 1"
                        ))
                    })?;
                }
                _ => passed.push(pair),
            }
        }
        let rest = if passed.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", passed.join("&"))
        };
        let mut config: postgres::Config = rest.parse().map_err(|e| {
            // The driver does not say which part it refused; an option is tried alone.
            let refused = passed.iter().find(|pair| {
                format!("{base}?{pair}")
                    .parse::<postgres::Config>()
                    .is_err()
            });
            bad(match refused {
                Some(pair) => format!(
                    "option {pair:?} is unknown or its value is invalid; expected libpq's \
                     options (sslmode, connect_timeout, …) or ratchet's pool=N"
                ),
                None => format!("{e}; expected postgres://user[:password]@host[:port]/database"),
            })
        })?;
        if config.get_hosts().is_empty() {
            return Err(bad(
                "expected a host, as in postgres://user@host:5432/database".into(),
            ));
        }
        if config.get_ssl_mode() == SslMode::Require {
            return Err(bad(
                "sslmode=require: this build connects without TLS; expected sslmode=disable or \
                 prefer (through a TLS-terminating proxy or a private network)"
                    .into(),
            ));
        }
        if config.get_application_name().is_none() {
            config.application_name("ratchet");
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(DEFAULT_CONNECT_TIMEOUT);
        }
        Ok(PgOptions {
            config,
            pool,
            migrate: true,
        })
    }
}

/// The url as it may be shown: without its password.
fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_owned();
    };
    match rest[..at].split_once(':') {
        Some((user, _password)) => format!("{scheme}://{user}:***{}", &rest[at..]),
        None => url.to_owned(),
    }
}

/// Brings the database's schema up to date and returns its version. Safe to run while other
/// processes open the same database: they wait for it.
pub fn migrate(url: &str) -> Result<u32> {
    let options = PgOptions::from_url(url)?;
    off_runtime(|| {
        let mut client = connect(&options.config)?;
        schema::migrate(&mut client)
    })
}

/// The PostgreSQL store.
pub type PgStore = SqlStore<PgBackend>;

/// Connects to the database a `postgres://` url names, migrating its schema unless the url's
/// options say otherwise.
pub fn open_url(url: &str) -> Result<PgStore> {
    PgBackend::open_url(url).map(SqlStore::new)
}

pub fn open(options: PgOptions) -> Result<PgStore> {
    PgBackend::open(options).map(SqlStore::new)
}

/// The store's backend on one PostgreSQL database (see the crate documentation).
pub struct PgBackend {
    shared: Arc<Shared>,
}

struct Shared {
    config: postgres::Config,
    idle: Mutex<Vec<Conn>>,
    /// One permit per connection of the pool: a caller holds one while its body runs.
    slots: Arc<Semaphore>,
    /// Made when the backend opens; starts every notification this backend sends, so that
    /// its own follower can pass over them.
    origin: String,
    configs: Configs,
}

impl PgBackend {
    /// Connects, and migrates the schema unless `options.migrate` is false (then a schema
    /// behind this build is an error).
    pub fn open(options: PgOptions) -> Result<PgBackend> {
        let PgOptions {
            config,
            pool,
            migrate,
        } = options;
        let first = off_runtime(|| -> Result<Conn> {
            let mut client = connect(&config)?;
            if migrate {
                schema::migrate(&mut client)?;
            } else {
                schema::check(&mut client)?;
            }
            Ok(Conn::new(client))
        })?;
        Ok(PgBackend {
            shared: Arc::new(Shared {
                config,
                idle: Mutex::new(vec![first]),
                slots: Arc::new(Semaphore::new(pool)),
                origin: uuid::Uuid::now_v7().simple().to_string(),
                configs: Configs::default(),
            }),
        })
    }

    /// `open(PgOptions::from_url(url)?)`.
    pub fn open_url(url: &str) -> Result<PgBackend> {
        PgBackend::open(PgOptions::from_url(url)?)
    }

    /// Runs `body` in a transaction of the given access on a pooled connection.
    fn run<R, F>(&self, access: Access, body: F) -> impl Future<Output = Result<R>> + Send + 'static
    where
        R: Send + 'static,
        F: FnOnce(&dyn Db) -> Result<R> + Send + 'static,
    {
        let shared = Arc::clone(&self.shared);
        async move {
            let permit = Arc::clone(&shared.slots)
                .acquire_owned()
                .await
                .map_err(|_| Error::Backend("the connection pool is closed".into()))?;
            tokio::task::spawn_blocking(move || {
                let _permit = permit;
                shared.transaction(access, body)
            })
            .await
            .map_err(|e| Error::Backend(format!("a store task failed: {e}")))?
        }
    }
}

impl Shared {
    fn transaction<R>(&self, access: Access, body: impl FnOnce(&dyn Db) -> Result<R>) -> Result<R> {
        let mut conn = self.checkout()?;
        if let Err(error) = conn.begin(access) {
            if conn.is_reusable() {
                self.checkin(conn);
                return Err(error);
            }
            // The server closed the idle connection (a restart, an idle timeout) and the
            // client learnt it only now. Nothing of the body ran: a new connection serves it.
            conn = connect(&self.config).map(Conn::new)?;
            conn.begin(access)?;
        }
        let outcome = conn.run(&self.origin, &self.configs, body);
        self.checkin(conn);
        outcome
    }

    /// Returns a connection to the pool, unless it cannot serve again.
    fn checkin(&self, conn: Conn) {
        if conn.is_reusable() {
            self.idle().push(conn);
        }
    }

    /// The idle connections. Nothing panics while holding them, so a poisoned lock still
    /// guards a whole list.
    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Conn>> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An idle connection that is still open, or a new one.
    fn checkout(&self) -> Result<Conn> {
        loop {
            let idle = self.idle().pop();
            match idle {
                Some(conn) if conn.is_reusable() => return Ok(conn),
                // The server closed it while it was idle (a restart, an idle timeout).
                Some(_closed) => continue,
                None => return connect(&self.config).map(Conn::new),
            }
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Closing a synchronous client blocks on its own runtime, which tokio forbids on an
        // async worker, where the last handle of a backend is often dropped.
        let idle = std::mem::take(self.idle.get_mut().unwrap_or_else(PoisonError::into_inner));
        if !idle.is_empty() {
            let _ = std::thread::Builder::new()
                .name("ratchet-postgres-close".into())
                .spawn(move || drop(idle));
        }
    }
}

impl Backend for PgBackend {
    fn write<R, F>(&self, body: F) -> impl Future<Output = Result<R>> + Send
    where
        R: Send + 'static,
        F: FnOnce(&dyn Db) -> Result<R> + Send + 'static,
    {
        self.run(Access::Write, body)
    }

    fn read<R, F>(&self, body: F) -> impl Future<Output = Result<R>> + Send
    where
        R: Send + 'static,
        F: FnOnce(&dyn Db) -> Result<R> + Send + 'static,
    {
        self.run(Access::Read, body)
    }

    fn search_messages(
        &self,
        scope: SearchScope,
        query: String,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<MessageHit>>> + Send {
        let words = search::words(&query);
        let search = words.map(|words| {
            self.run(Access::Read, move |db| {
                search::search(db, &scope, &words, limit)
            })
        });
        async move { search?.await }
    }

    fn changes(&self) -> Option<ChangeStream> {
        changes::follow(self.shared.config.clone(), self.shared.origin.clone())
    }
}

/// Opens one connection. Blocks: call it off the async workers (see `off_runtime`).
fn connect(config: &postgres::Config) -> Result<postgres::Client> {
    config
        .connect(postgres::NoTls)
        .map_err(|e| Error::Backend(format!("cannot connect to PostgreSQL: {}", describe(&e))))
}

/// Runs blocking connection work on a thread of its own. The synchronous client drives its
/// own small runtime, which tokio refuses to start inside another runtime's worker, and
/// opening a backend is often called from async code.
fn off_runtime<T: Send>(work: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|scope| {
        scope
            .spawn(work)
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// The store's error for a driver error: what the server said, and for the conflicts that
/// only a concurrent transaction causes, that nothing was kept and the operation may be
/// tried again.
pub(crate) fn backend_error(error: &postgres::Error) -> Error {
    Error::Backend(describe(error))
}

pub(crate) fn describe(error: &postgres::Error) -> String {
    let Some(db) = error.as_db_error() else {
        if error.is_closed() {
            return format!("the connection to PostgreSQL was lost ({error})");
        }
        // The driver's own text leaves out the cause (which parameter did not fit, and why).
        let mut text = error.to_string();
        let mut source = std::error::Error::source(error);
        while let Some(cause) = source {
            text = format!("{text}: {cause}");
            source = cause.source();
        }
        return text;
    };
    let mut text = format!("{} (SQLSTATE {})", db.message(), db.code().code());
    if let Some(detail) = db.detail() {
        text.push_str(": ");
        text.push_str(detail);
    }
    let conflict = match *db.code() {
        SqlState::T_R_SERIALIZATION_FAILURE => Some("a serialization failure"),
        SqlState::T_R_DEADLOCK_DETECTED => Some("a deadlock"),
        _ => None,
    };
    if let Some(conflict) = conflict {
        text = format!(
            "the transaction met {conflict} with a concurrent one and was rolled back; nothing \
             was kept and the operation may be tried again: {text}"
        );
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bad_url_reason(url: &str) -> String {
        match PgOptions::from_url(url) {
            Err(Error::BadUrl { reason, .. }) => reason,
            other => panic!("{url}: expected BadUrl, got {other:?}"),
        }
    }

    #[test]
    fn a_url_names_the_server_and_ratchet_takes_its_own_options_out() {
        let options = PgOptions::from_url("postgres://app@db.internal:6543/ratchet").unwrap();
        assert_eq!(options.pool, DEFAULT_POOL);
        assert!(options.migrate);
        assert_eq!(options.config.get_user(), Some("app"));
        assert_eq!(options.config.get_dbname(), Some("ratchet"));
        assert_eq!(options.config.get_ports(), [6543]);
        assert_eq!(options.config.get_application_name(), Some("ratchet"));

        let options = PgOptions::from_url(
            "postgresql://app@localhost/ratchet?pool=3&application_name=worker&connect_timeout=2",
        )
        .unwrap();
        assert_eq!(options.pool, 3);
        assert_eq!(options.config.get_application_name(), Some("worker"));
        assert_eq!(
            options.config.get_connect_timeout(),
            Some(&Duration::from_secs(2))
        );
    }

    #[test]
    fn a_bad_url_says_what_was_expected() {
        assert!(bad_url_reason("mysql://x@y/z").contains("postgres://"));
        assert!(bad_url_reason("postgres://x@y/z?pool=0").contains("at least 1"));
        assert!(bad_url_reason("postgres://x@y/z?pool=many").contains("pool=many"));
        let unknown = bad_url_reason("postgres://x@y/z?poolsize=4");
        assert!(
            unknown.contains("poolsize") && unknown.contains("pool=N"),
            "{unknown}"
        );
        assert!(bad_url_reason("postgres:///z").contains("expected a host"));
        assert!(bad_url_reason("postgres://x@y/z?sslmode=require").contains("without TLS"));
    }

    #[test]
    fn a_password_never_appears_in_an_error() {
        match PgOptions::from_url("postgres://app:s3cret@host/db?pool=x") {
            Err(error) => {
                let text = error.to_string();
                assert!(!text.contains("s3cret"), "{text}");
                assert!(text.contains("app:***@host/db"), "{text}");
            }
            Ok(_) => panic!("pool=x is not a number"),
        }
        assert_eq!(redacted("postgres://app@host/db"), "postgres://app@host/db");
    }
}
