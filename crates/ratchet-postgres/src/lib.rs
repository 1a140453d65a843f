//! PostgreSQL adapter of the store: the transaction bodies of `ratchet-store-sql` run on a small
//! pool of synchronous connections, one transaction each, on tokio's blocking threads.
//!
//! Several processes may share one database. Writes to a session are serial because each
//! takes the session's row lock first (`Db::lock_session`); claims pass over the job rows
//! others are taking (`FOR UPDATE SKIP LOCKED`); each process hears what the others commit
//! through LISTEN/NOTIFY (`changes`). Nothing here ever retries a transaction: a body runs
//! once, and a conflict with another process is reported, not hidden.
//!
//! Connections are encrypted with rustls as libpq's `sslmode` says (`tls`): `disable`;
//! `prefer`, the default, which encrypts when the server offers it; `require`, which
//! encrypts and, like libpq, accepts any certificate unless `sslrootcert` names the roots to
//! trust; `verify-ca`, which checks the certificate's chain against those roots (or the
//! system's); and `verify-full`, which also checks that the certificate names the host.
//! Every connection of a backend (the pool's, migration's and the change follower's) goes
//! through the same connector.

mod changes;
mod db;
mod schema;
mod search;
#[cfg(feature = "testkit")]
pub mod testkit;
mod tls;

use std::future::Future;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use postgres::error::SqlState;
use ratchet_core::Millis;
use ratchet_store::{ChangeStream, Error, MessageHit, Migrated, SearchScope};
use ratchet_store_sql::{Backend, Configs, Db, SqlStore};
use tokio::sync::Semaphore;

use db::{Access, Conn};
pub use schema::LATEST as SCHEMA_VERSION;
pub use tls::{SslMode, Tls};

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Connections a backend opens when the url does not say (`pool=N`).
const DEFAULT_POOL: usize = 8;

/// How long opening a connection may take when the url does not say (`connect_timeout`).
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How to reach the database and how to use it.
#[derive(Debug, Clone)]
pub struct PgOptions {
    /// Where the server is and who connects (everything of the url but ratchet's options).
    /// Its `ssl_mode` is not read: `tls` says how connections are secured.
    pub config: tokio_postgres::Config,
    /// How every connection is secured (`sslmode`, `sslrootcert`).
    pub tls: Tls,
    /// Most connections open at once for reads and writes; callers beyond wait for one. The
    /// follower of `changes` has a connection of its own.
    pub pool: usize,
    /// Bring the schema up to date when opening. When false, a schema behind this build makes
    /// opening fail (an operator runs `ratchet migrate` instead).
    pub migrate: bool,
}

impl PgOptions {
    /// Parses `postgres://user[:password]@host[:port]/database[?options]` (or
    /// `postgresql://`). These options are read here and taken out before the rest reaches
    /// the driver:
    ///
    /// - `pool=N`: at most N connections for reads and writes (8 when unset);
    /// - `sslmode=disable|prefer|require|verify-ca|verify-full`, as in libpq (`prefer` when
    ///   unset; see `SslMode`);
    /// - `sslrootcert=FILE`: the PEM root certificates that `verify-ca` and `verify-full`
    ///   trust instead of the system's, and that make `require` check the chain as
    ///   `verify-ca` does; its path is percent-encoded like any option's value. `disable`
    ///   ignores it, and `prefer` refuses it (libpq would check the chain, then fall back
    ///   to plain when the check fails).
    ///
    /// The driver reads the others (`connect_timeout`, `application_name`, `sslnegotiation`,
    /// …). An option given twice takes its last value. An unknown option or value, and a root
    /// file that cannot be read or holds no usable certificate, are `Error::BadUrl`s that say
    /// what was expected.
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
        let mut ssl_mode = SslMode::default();
        let mut root_cert = None;
        let mut passed = Vec::new();
        // As in libpq, an option given twice takes its last value.
        for pair in query.split('&').filter(|pair| !pair.is_empty()) {
            match pair.split_once('=') {
                Some(("pool", count)) => {
                    pool = count.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                        bad(format!(
                            "pool={count}: expected a number of connections, at least 1"
                        ))
                    })?;
                }
                Some(("sslmode", mode)) => {
                    ssl_mode = SslMode::parse(mode).ok_or_else(|| {
                        bad(format!(
                            "sslmode={mode}: expected disable, prefer, require, verify-ca or \
                             verify-full"
                        ))
                    })?;
                }
                Some(("sslrootcert", path)) => {
                    let path = percent_encoding::percent_decode_str(path)
                        .decode_utf8()
                        .ok()
                        .filter(|path| !path.is_empty())
                        .ok_or_else(|| {
                            bad(format!(
                                "sslrootcert={path}: expected the path of a PEM file, \
                                 percent-encoded as UTF-8"
                            ))
                        })?;
                    root_cert = Some(path.into_owned());
                }
                _ => passed.push(pair),
            }
        }
        let tls = Tls::build(ssl_mode, root_cert.as_deref().map(Path::new)).map_err(bad)?;
        let rest = if passed.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", passed.join("&"))
        };
        let mut config: tokio_postgres::Config = rest.parse().map_err(|e| {
            // The driver does not say which part it refused; an option is tried alone.
            let refused = passed.iter().find(|pair| {
                format!("{base}?{pair}")
                    .parse::<tokio_postgres::Config>()
                    .is_err()
            });
            bad(match refused.map(|pair| redacted(pair)) {
                Some(pair) => format!(
                    "option {pair:?} is unknown or its value is invalid; expected libpq's \
                     options (sslmode, sslrootcert, connect_timeout, …) or ratchet's pool=N"
                ),
                None => format!("{e}; expected postgres://user[:password]@host[:port]/database"),
            })
        })?;
        if config.get_hosts().is_empty() {
            return Err(bad(
                "expected a host, as in postgres://user@host:5432/database".into(),
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
            tls,
            pool,
            migrate: true,
        })
    }

    /// What opens this backend's connections, every one alike.
    fn connector(&self) -> Connector {
        let mut config = self.config.clone();
        self.tls.configure(&mut config);
        Connector {
            config,
            tls: self.tls.clone(),
        }
    }
}

/// Opens connections: the pool's, migration's, the change follower's and the testkit's, all
/// through one TLS connector.
#[derive(Clone)]
pub(crate) struct Connector {
    /// The options' configuration with the driver's `ssl_mode` set from `tls`.
    config: tokio_postgres::Config,
    tls: Tls,
}

impl Connector {
    /// Opens one synchronous connection (migration's, the change follower's). Blocks: call it
    /// off the async workers (see `off_runtime`).
    pub(crate) fn connect(&self) -> Result<postgres::Client> {
        postgres::Config::from(self.config.clone())
            .connect(self.tls.connector())
            .map_err(|e| self.refused(&e))
    }

    /// Opens one connection of the pool, on a runtime of its own. Blocks, like `connect`.
    pub(crate) fn connect_pooled(&self) -> Result<Conn> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Backend(format!("cannot start a connection's runtime: {e}")))?;
        let (client, connection) = runtime
            .block_on(self.config.connect(self.tls.connector()))
            .map_err(|e| self.refused(&e))?;
        runtime.spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(error = %describe(&error), "a pooled PostgreSQL connection closed");
            }
        });
        Ok(Conn::new(runtime, client))
    }

    fn refused(&self, error: &postgres::Error) -> Error {
        Error::Backend(format!(
            "cannot connect to PostgreSQL ({}): {}",
            self.tls,
            describe(error)
        ))
    }
}

/// A url, or a part of one, as it may be shown: without its password, however it was
/// written — a mistyped scheme, a password holding `@`, `/` or `?`, a `password=` option. A
/// strange url may have more hidden than its password, never less. `serve` and `worker` print
/// their database this way, since their output ends up in logs.
pub fn redacted(url: &str) -> String {
    let shown = match url.rfind('@') {
        None => url.to_owned(),
        Some(at) => match url[..at].find("//") {
            Some(slashes) => match url[slashes + 2..at].split_once(':') {
                Some((user, _password)) => {
                    format!("{}{user}:***{}", &url[..slashes + 2], &url[at..])
                }
                None => url.to_owned(),
            },
            None => format!("***{}", &url[at..]),
        },
    };
    shown
        .split_inclusive(['?', '&'])
        .map(|part| match part.strip_prefix("password=") {
            Some(value) => {
                let separator = value
                    .ends_with(['?', '&'])
                    .then(|| &value[value.len() - 1..]);
                format!("password=***{}", separator.unwrap_or_default())
            }
            None => part.to_owned(),
        })
        .collect()
}

/// Brings the database's schema up to date, returning its version before and after. Safe to
/// run while other processes open the same database: they wait for it.
pub fn migrate(options: &PgOptions) -> Result<Migrated> {
    let connector = options.connector();
    off_runtime(|| {
        let mut client = connector.connect()?;
        schema::migrate(&mut client)
    })
}

/// The bytes the database takes on the server's disk now (`pg_database_size`).
pub fn database_bytes(options: &PgOptions) -> Result<u64> {
    let connector = options.connector();
    off_runtime(|| {
        let mut client = connector.connect()?;
        let row = client
            .query_one("SELECT pg_database_size(current_database())", &[])
            .map_err(|e| backend_error(&e))?;
        let bytes: i64 = row.get(0);
        u64::try_from(bytes)
            .map_err(|_| Error::Backend(format!("pg_database_size gave {bytes}, expected a size")))
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
    connector: Connector,
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
        let connector = options.connector();
        let PgOptions { pool, migrate, .. } = options;
        let first = off_runtime(|| -> Result<Conn> {
            let mut client = connector.connect()?;
            if migrate {
                schema::migrate(&mut client)?;
            } else {
                schema::check(&mut client)?;
            }
            connector.connect_pooled()
        })?;
        Ok(PgBackend {
            shared: Arc::new(Shared {
                connector,
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
            conn = self.connector.connect_pooled()?;
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
                None => return self.connector.connect_pooled(),
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
        changes::follow(self.shared.connector.clone(), self.shared.origin.clone())
    }

    /// The server's clock as the statement runs (`clock_timestamp()`, not the transaction's
    /// start).
    fn database_now(&self) -> impl Future<Output = Result<Option<Millis>>> + Send {
        self.run(Access::Read, |db| {
            let mut row = db
                .query_opt(
                    "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint",
                    &[],
                )?
                .ok_or_else(|| Error::Backend("the clock query returned no row".into()))?;
            Ok(Some(row.int(0)?))
        })
    }
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
    use std::path::PathBuf;

    use proptest::prelude::*;

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
    }

    /// A root certificate that signed no server (also used by the integration tests).
    const UNRELATED_ROOT: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/unrelated-root.pem"
    );

    fn tls_of(query: &str) -> (SslMode, Option<PathBuf>) {
        let url = format!("postgres://app@db/x{query}");
        let options = PgOptions::from_url(&url).unwrap_or_else(|e| panic!("{url}: {e}"));
        (
            options.tls.mode(),
            options.tls.root_cert().map(Path::to_path_buf),
        )
    }

    #[test]
    fn sslmode_and_sslrootcert_are_read_as_libpq_reads_them() {
        assert_eq!(tls_of(""), (SslMode::Prefer, None), "libpq's default");
        for mode in ["disable", "prefer", "require"] {
            assert_eq!(tls_of(&format!("?sslmode={mode}")).0.as_str(), mode);
        }
        // The driver refuses both verify modes and sslrootcert: these never reach it.
        for mode in ["require", "verify-ca", "verify-full"] {
            assert_eq!(
                tls_of(&format!("?sslmode={mode}&sslrootcert={UNRELATED_ROOT}")),
                (SslMode::parse(mode).unwrap(), Some(UNRELATED_ROOT.into())),
            );
        }
        assert_eq!(
            tls_of("?sslmode=require&application_name=w&sslmode=disable").0,
            SslMode::Disable,
            "an option given twice takes its last value"
        );
        assert_eq!(
            tls_of("?sslmode=disable&sslrootcert=/nowhere/root.pem"),
            (SslMode::Disable, None),
            "disable reads no root file, as in libpq"
        );

        let dir = tempfile::tempdir().unwrap();
        let spaced = dir.path().join("root ca.pem");
        std::fs::copy(UNRELATED_ROOT, &spaced).unwrap();
        let encoded = spaced.to_str().unwrap().replace(' ', "%20");
        assert_eq!(
            tls_of(&format!("?sslmode=verify-ca&sslrootcert={encoded}")).1,
            Some(spaced),
            "the path is percent-decoded"
        );
    }

    #[test]
    fn bad_tls_options_say_what_was_expected() {
        let reason = bad_url_reason("postgres://x@y/z?sslmode=verify");
        assert!(
            reason.contains("sslmode=verify:") && reason.contains("verify-ca or verify-full"),
            "{reason}"
        );
        let reason = bad_url_reason("postgres://x@y/z?sslmode=verify-ca&sslrootcert=");
        assert!(
            reason.contains("expected the path of a PEM file"),
            "{reason}"
        );
        let reason = bad_url_reason("postgres://x@y/z?sslmode=verify-ca&sslrootcert=%FF");
        assert!(reason.contains("percent-encoded as UTF-8"), "{reason}");

        let reason =
            bad_url_reason("postgres://x@y/z?sslmode=verify-full&sslrootcert=/nowhere/root.pem");
        assert!(
            reason.contains("sslrootcert=/nowhere/root.pem cannot be read")
                && reason.contains("No such file")
                && reason.contains("expected a PEM file of root certificates"),
            "{reason}"
        );

        let dir = tempfile::tempdir().unwrap();
        for (name, text, expected) in [
            ("empty.pem", "", "holds no certificate"),
            ("words.pem", "not a certificate\n", "holds no certificate"),
            (
                "key.pem",
                "-----BEGIN PRIVATE KEY-----\naGVsbG8=\n-----END PRIVATE KEY-----\n",
                "holds no certificate",
            ),
            (
                "base64.pem",
                "-----BEGIN CERTIFICATE-----\n#not base64#\n-----END CERTIFICATE-----\n",
                "cannot be read",
            ),
            (
                "garbage.pem",
                "-----BEGIN CERTIFICATE-----\naGVsbG8=\n-----END CERTIFICATE-----\n",
                "holds a certificate that cannot be a root",
            ),
        ] {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            let reason = bad_url_reason(&format!(
                "postgres://x@y/z?sslmode=verify-ca&sslrootcert={}",
                path.display()
            ));
            assert!(reason.contains(expected), "{name}: {reason}");
        }

        for mode in ["", "&sslmode=prefer"] {
            let reason = bad_url_reason(&format!(
                "postgres://x@y/z?sslrootcert={UNRELATED_ROOT}{mode}"
            ));
            assert!(
                reason.contains("checks no certificate")
                    && reason.contains("expected sslmode=require, verify-ca or verify-full"),
                "{mode}: {reason}"
            );
        }
        match Tls::new(SslMode::Prefer, Some(Path::new(UNRELATED_ROOT))) {
            Err(Error::Invalid(reason)) => assert!(reason.contains("sslmode=prefer"), "{reason}"),
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    /// A server that says no to TLS must not get a connection in plain from a mode that
    /// requires TLS: the driver is told to require it, whatever the connector would check.
    #[test]
    fn a_mode_that_requires_tls_refuses_a_server_without_it() {
        use std::io::{Read, Write};

        let modes = [
            ("sslmode=require".to_owned(), true),
            (
                format!("sslmode=verify-ca&sslrootcert={UNRELATED_ROOT}"),
                true,
            ),
            (
                format!("sslmode=verify-full&sslrootcert={UNRELATED_ROOT}"),
                true,
            ),
            ("sslmode=prefer".to_owned(), false),
        ];
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let clients = modes.len();
        let server = std::thread::spawn(move || {
            for stream in listener.incoming().take(clients) {
                let mut stream = stream.unwrap();
                let mut request = [0; 8];
                stream.read_exact(&mut request).unwrap();
                // Length 8, then the SSLRequest code 80877103.
                assert_eq!(request, [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f]);
                stream.write_all(b"N").unwrap();
                // A client that goes on in plain sends its startup message; either way the
                // connection ends here.
                let _ = stream.read(&mut [0; 512]);
            }
        });
        for (query, refused) in &modes {
            let url = format!("postgres://app@127.0.0.1:{port}/x?{query}");
            let Err(error) = PgOptions::from_url(&url).unwrap().connector().connect() else {
                panic!("{query}: the server never lets a client in");
            };
            let message = error.to_string();
            assert_eq!(
                message.contains("server does not support TLS"),
                *refused,
                "{query}: {message}"
            );
        }
        server.join().unwrap();
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
        for (url, shown) in [
            (
                "postgresq//app:s3cret@host/db",
                "postgresq//app:***@host/db",
            ),
            ("postgres:app:s3cret@host/db", "***@host/db"),
            (
                "postgres://app:s3/c?r@t@host/db",
                "postgres://app:***@host/db",
            ),
            (
                "postgres://app@host/db?pool=2&password=s3cret",
                "postgres://app@host/db?pool=2&password=***",
            ),
        ] {
            assert_eq!(redacted(url), shown);
        }
        let Err(error) = PgOptions::from_url("postgres://app@host/db?password=s3cret&pool=x")
        else {
            panic!("pool=x is not a number");
        };
        assert!(!error.to_string().contains("s3cret"), "{error}");
    }

    /// One of the options a generated url carries, and what it means.
    #[derive(Debug, Clone)]
    enum Opt {
        Pool(usize),
        SslMode(&'static str),
        ApplicationName(String),
        ConnectTimeout(u64),
    }

    impl Opt {
        fn text(&self) -> String {
            match self {
                Opt::Pool(n) => format!("pool={n}"),
                Opt::SslMode(mode) => format!("sslmode={mode}"),
                Opt::ApplicationName(name) => format!("application_name={name}"),
                Opt::ConnectTimeout(secs) => format!("connect_timeout={secs}"),
            }
        }
    }

    fn opt() -> impl Strategy<Value = Opt> {
        prop_oneof![
            (1usize..64).prop_map(Opt::Pool),
            proptest::sample::select(vec!["disable", "prefer", "require"]).prop_map(Opt::SslMode),
            "[a-z]{1,8}".prop_map(Opt::ApplicationName),
            (1u64..100).prop_map(Opt::ConnectTimeout),
        ]
    }

    /// A url of the documented form. The password starts with `PW`, which nothing else in
    /// the url contains, so any appearance of it in a message is a leak.
    #[derive(Debug, Clone)]
    struct Url {
        scheme: &'static str,
        user: String,
        password: Option<String>,
        host: String,
        port: Option<u16>,
        database: String,
        options: Vec<Opt>,
    }

    impl Url {
        fn text(&self) -> String {
            let password = self
                .password
                .as_ref()
                .map(|p| format!(":{p}"))
                .unwrap_or_default();
            let port = self.port.map(|p| format!(":{p}")).unwrap_or_default();
            let options: Vec<String> = self.options.iter().map(Opt::text).collect();
            let query = if options.is_empty() {
                String::new()
            } else {
                format!("?{}", options.join("&"))
            };
            format!(
                "{}://{}{password}@{}{port}/{}{query}",
                self.scheme, self.user, self.host, self.database
            )
        }
    }

    fn url() -> impl Strategy<Value = Url> {
        (
            proptest::sample::select(vec!["postgres", "postgresql"]),
            "[a-z][a-z0-9_]{0,8}",
            proptest::option::of("PW[A-Za-z0-9]{6,10}"),
            "[a-z][a-z0-9]{0,8}(\\.[a-z0-9]{1,5}){0,2}",
            proptest::option::of(1u16..),
            "[a-z][a-z0-9_]{0,8}",
            proptest::collection::vec(opt(), 0..5),
        )
            .prop_map(
                |(scheme, user, password, host, port, database, options)| Url {
                    scheme,
                    user,
                    password,
                    host,
                    port,
                    database,
                    options,
                },
            )
    }

    /// What every answer of the parser must respect: an error is a `BadUrl` with a reason,
    /// and it never shows a password.
    fn check_refusal(result: &Result<PgOptions>, password: Option<&str>) {
        let Err(error) = result else { return };
        let Error::BadUrl { reason, .. } = error else {
            panic!("not a BadUrl: {error:?}");
        };
        assert!(!reason.trim().is_empty(), "{error}");
        if let Some(password) = password {
            assert!(
                !error.to_string().contains(password),
                "the password shows: {error}"
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn any_text_is_a_url_or_a_reason(
            text in prop_oneof![
                any::<String>(),
                any::<String>().prop_map(|rest| format!("postgres://{rest}")),
                "postgres://[a-z:@\\[\\]/?&=%,.0-9]{0,30}",
            ],
        ) {
            check_refusal(&PgOptions::from_url(&text), None);
        }

        /// A url of the documented form is read as it says: the server's address and
        /// credentials for the driver, ratchet's own options (the last of each) taken out.
        #[test]
        fn a_written_url_means_what_it_says(url in url()) {
            let options = PgOptions::from_url(&url.text()).unwrap_or_else(|e| panic!("{}: {e}", url.text()));
            let config = &options.config;
            prop_assert_eq!(config.get_user(), Some(url.user.as_str()));
            prop_assert_eq!(config.get_password(), url.password.as_deref().map(str::as_bytes));
            prop_assert_eq!(config.get_dbname(), Some(url.database.as_str()));
            prop_assert_eq!(config.get_hosts(), [postgres::config::Host::Tcp(url.host.clone())]);
            prop_assert_eq!(config.get_ports(), [url.port.unwrap_or(5432)]);
            let last = |pick: fn(&Opt) -> Option<String>| url.options.iter().rev().find_map(pick);
            let pool = last(|o| match o { Opt::Pool(n) => Some(n.to_string()), _ => None });
            prop_assert_eq!(options.pool.to_string(), pool.unwrap_or(DEFAULT_POOL.to_string()));
            let mode = last(|o| match o { Opt::SslMode(m) => Some((*m).to_owned()), _ => None });
            prop_assert_eq!(options.tls.mode().as_str(), mode.as_deref().unwrap_or("prefer"));
            let name = last(|o| match o { Opt::ApplicationName(n) => Some(n.clone()), _ => None });
            prop_assert_eq!(config.get_application_name(), Some(name.as_deref().unwrap_or("ratchet")));
            let timeout = last(|o| match o { Opt::ConnectTimeout(s) => Some(s.to_string()), _ => None });
            let timeout = timeout.map_or(DEFAULT_CONNECT_TIMEOUT, |s| Duration::from_secs(s.parse().unwrap()));
            prop_assert_eq!(config.get_connect_timeout(), Some(&timeout));
        }

        /// A documented url with one mistake in it is refused with a reason that names the
        /// mistake and never shows the password.
        #[test]
        fn a_mistake_is_named_and_the_password_stays_hidden(
            url in url(),
            (mistake, named) in proptest::sample::select(vec![
                ("pool=0", "pool=0"),
                ("pool=many", "pool=many"),
                ("sslmode=verify", "sslmode=verify"),
                ("colour=red", "colour=red"),
                ("connect_timeout=soon", "connect_timeout=soon"),
                ("sslrootcert=", "sslrootcert="),
            ]),
            at in any::<proptest::sample::Index>(),
        ) {
            let mut options: Vec<String> = url.options.iter().map(Opt::text).collect();
            options.insert(at.index(options.len() + 1), mistake.to_owned());
            let text = format!("{}?{}", url.text().split('?').next().unwrap(), options.join("&"));
            let result = PgOptions::from_url(&text);
            check_refusal(&result, url.password.as_deref());
            let error = result.err().unwrap().to_string();
            prop_assert!(error.contains(named), "{}: {}", text, error);
        }

        /// Damaged urls: read or refused with a reason, never a panic, never the password.
        #[test]
        fn a_damaged_url_is_read_or_refused(
            url in url(),
            edits in proptest::collection::vec(
                (any::<usize>(), 0usize..4, "[:@/?&=%#\\[\\],a-z0-9]{0,3}"),
                1..4,
            ),
        ) {
            let mut text: Vec<char> = url.text().chars().collect();
            for (at, delete, insert) in &edits {
                let start = at % (text.len() + 1);
                let end = (start + delete).min(text.len());
                text.splice(start..end, insert.chars());
            }
            let text: String = text.into_iter().collect();
            let password = url.password.as_deref().filter(|p| text.contains(&format!(":{p}@")));
            check_refusal(&PgOptions::from_url(&text), password);
        }
    }
}
