//! SQLite backend of the store: one file, WAL, `synchronous=FULL` by default.
//!
//! One writer thread owns the only write connection and group-commits (see `writer`); reads
//! use their own connections. Every write transaction starts with `BEGIN IMMEDIATE`, so a
//! second process on the same file waits on `busy_timeout` instead of failing.

mod schema;
mod search;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ratchet_store::{Error, MessageHit, SearchScope};
use ratchet_store_sql::{Announcement, Backend, Configs, Db, Param, Row, SqlStore, Value};
use rusqlite::config::DbConfig;
use rusqlite::types::{ToSqlOutput, ValueRef};
use rusqlite::{Connection, OpenFlags};

pub use schema::{Migrated, VERSION as SCHEMA_VERSION};
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
    /// Apply the migrations the database lacks when opening it (creating it if needed). When
    /// false, opening refuses a database that does not exist or whose schema is behind.
    pub migrate: bool,
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
            migrate: true,
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

/// The bytes the database at `path` holds as a reader sees it now: its pages, those still in
/// the WAL included (`page_count × page_size`), whether or not a checkpoint has run.
pub fn database_bytes(path: &Path) -> Result<u64> {
    let conn = open_connection(path, true)?;
    let pragma = |name: &str| -> Result<u64> {
        let value: i64 = conn
            .query_row(&format!("PRAGMA {name}"), [], |row| row.get(0))
            .map_err(backend)?;
        u64::try_from(value)
            .map_err(|_| Error::Backend(format!("PRAGMA {name} gave {value}, expected a count")))
    };
    Ok(pragma("page_count")? * pragma("page_size")?)
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
    // Plans that never depend on the values bound. Without this, SQLite marks a statement
    // whose plan *could* depend on a bound value (an equality on `?N` it might not use, in a
    // join or subquery) to be compiled again whenever its bindings are cleared, which the
    // statement cache does each time it takes a statement back: the step's commit read was
    // parsed and planned anew on every step. There are no statistics (`ANALYZE`) here for
    // a value to make a better plan with.
    conn.set_db_config(DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)
        .map_err(backend)?;
    conn.set_prepared_statement_cache_capacity(64);
    Ok(conn)
}

/// A connection as the transaction bodies see it, with the cache of run configurations.
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

/// Binds a statement parameter as SQLite's own value.
struct Bound<'a>(Param<'a>);

impl rusqlite::ToSql for Bound<'_> {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        let value = match self.0 {
            Param::Int(Some(value)) => ValueRef::Integer(value),
            Param::Real(Some(value)) => ValueRef::Real(value),
            Param::Text(Some(value)) => ValueRef::Text(value.as_bytes()),
            Param::Int(None) | Param::Real(None) | Param::Text(None) => ValueRef::Null,
        };
        Ok(ToSqlOutput::Borrowed(value))
    }
}

fn bind<'a>(params: &'a [Param<'a>]) -> impl Iterator<Item = Bound<'a>> {
    params.iter().map(|p| Bound(*p))
}

impl Db for Tx<'_> {
    fn execute(&self, sql: &str, params: &[Param<'_>]) -> Result<u64> {
        let changed = self
            .prepare_cached(sql)
            .and_then(|mut s| s.execute(rusqlite::params_from_iter(bind(params))))
            .map_err(backend)?;
        Ok(changed as u64)
    }

    fn query(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>> {
        let mut statement = self.prepare_cached(sql).map_err(backend)?;
        let width = statement.column_count();
        let mut rows = statement
            .query(rusqlite::params_from_iter(bind(params)))
            .map_err(backend)?;
        let mut read = Vec::new();
        while let Some(row) = rows.next().map_err(backend)? {
            let mut values = Vec::with_capacity(width);
            for column in 0..width {
                values.push(match row.get_ref(column).map_err(backend)? {
                    ValueRef::Null => Value::Null,
                    ValueRef::Integer(value) => Value::Int(value),
                    ValueRef::Real(value) => Value::Real(value),
                    ValueRef::Text(text) => Value::Text(
                        std::str::from_utf8(text)
                            .map_err(|e| Error::Corrupt(format!("text column {column}: {e}")))?
                            .to_owned(),
                    ),
                    ValueRef::Blob(_) => {
                        return Err(Error::Corrupt(format!(
                            "expected text or a number in column {column}, found a blob"
                        )));
                    }
                });
            }
            read.push(Row::new(values));
        }
        Ok(read)
    }

    /// The writer thread is the only writer: its transactions are serial already.
    fn lock_session(&self, _session_id: &str) -> Result<()> {
        Ok(())
    }

    fn lock_session_of_run(&self, _run_id: &str) -> Result<()> {
        Ok(())
    }

    fn lock_run_quota(&self) -> Result<()> {
        Ok(())
    }

    fn skip_locked(&self) -> &'static str {
        ""
    }

    fn for_update(&self) -> &'static str {
        ""
    }

    /// Another process on the same file finds new work and events by polling.
    fn announce(&self, _announcement: Announcement<'_>) -> Result<()> {
        Ok(())
    }

    fn configs(&self) -> &Configs {
        self.configs
    }
}

/// The SQLite store.
pub type SqliteStore = SqlStore<SqliteBackend>;

/// Opens (creating and migrating as needed) the database a `sqlite:` url names.
pub fn open_url(url: &str) -> Result<SqliteStore> {
    open(SqliteOptions::from_url(url)?)
}

pub fn open(options: SqliteOptions) -> Result<SqliteStore> {
    SqliteBackend::open(options).map(SqlStore::new)
}

/// The writer thread and the read connections of one database file.
pub struct SqliteBackend {
    writer: Writer,
    readers: Arc<Readers>,
}

/// Applies the migrations the database lacks (creating it if needed) and nothing else.
pub fn migrate(options: &SqliteOptions) -> Result<Migrated> {
    let mut conn = prepare(options)?;
    schema::migrate(&mut conn)
}

/// Opens the write connection: WAL, the durability asked for, foreign keys.
fn prepare(options: &SqliteOptions) -> Result<Connection> {
    if let Some(parent) = options.path.parent().filter(|p| !p.as_os_str().is_empty())
        && !parent.is_dir()
    {
        return Err(Error::BadUrl {
            url: options.path.display().to_string(),
            reason: format!("directory {} does not exist", parent.display()),
        });
    }
    let conn = open_connection(&options.path, false)?;
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
    Ok(conn)
}

impl SqliteBackend {
    fn open(options: SqliteOptions) -> Result<SqliteBackend> {
        if !options.migrate && !options.path.is_file() {
            return Err(Error::NotFound {
                kind: "database",
                id: options.path.display().to_string(),
            });
        }
        let mut conn = prepare(&options)?;
        // Each group-committed operation runs in a savepoint; its statement journal stays
        // in memory instead of a temporary file.
        conn.pragma_update(None, "temp_store", "MEMORY")
            .map_err(backend)?;
        conn.pragma_update(None, "cache_size", -65_536)
            .map_err(backend)?;
        if options.migrate {
            schema::migrate(&mut conn)?;
        } else {
            schema::require_current(&conn)?;
        }
        let configs = Arc::new(Configs::default());
        let writer = Writer::spawn(conn, Arc::clone(&configs))
            .map_err(|e| Error::Backend(format!("cannot start writer thread: {e}")))?;
        Ok(SqliteBackend {
            writer,
            readers: Readers::new(options.path, configs),
        })
    }
}

impl Backend for SqliteBackend {
    async fn write<R, F>(&self, body: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&dyn Db) -> Result<R> + Send + 'static,
    {
        self.writer.write(move |tx| body(tx)).await
    }

    async fn read<R, F>(&self, body: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&dyn Db) -> Result<R> + Send + 'static,
    {
        self.readers.read(move |tx| body(tx)).await
    }

    async fn search_messages(
        &self,
        scope: SearchScope,
        query: String,
        limit: u32,
    ) -> Result<Vec<MessageHit>> {
        self.writer.write(search::catch_up).await?;
        self.readers
            .read(move |c| search::search_messages(c, &scope, &query, limit))
            .await
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn any_text_is_a_url_or_a_reason(
            text in prop_oneof![
                any::<String>(),
                any::<String>().prop_map(|rest| format!("sqlite://{rest}")),
                "sqlite:(//)?[a-z/.:?&=]{0,20}",
            ],
        ) {
            match SqliteOptions::from_url(&text) {
                Ok(options) => {
                    prop_assert!(text.starts_with("sqlite:"));
                    prop_assert!(!options.path.as_os_str().is_empty());
                    prop_assert!(options.migrate);
                }
                Err(Error::BadUrl { url, reason }) => {
                    prop_assert_eq!(url, text);
                    prop_assert!(!reason.trim().is_empty());
                }
                Err(other) => prop_assert!(false, "not a BadUrl: {:?}", other),
            }
        }

        /// `sqlite://PATH?synchronous=…` names the file PATH, with the last durability given.
        #[test]
        fn a_written_url_means_what_it_says(
            slashes in prop_oneof![Just("//"), Just("")],
            path in "[^?]{1,30}".prop_filter("a file", |p| p != ":memory:"),
            modes in proptest::collection::vec(prop_oneof![Just("full"), Just("normal")], 0..3),
        ) {
            // `sqlite:` followed by `//` is the `sqlite://` form.
            prop_assume!(slashes == "//" || !path.starts_with("//"));
            let options: Vec<String> = modes.iter().map(|m| format!("synchronous={m}")).collect();
            let query = if options.is_empty() { String::new() } else { format!("?{}", options.join("&")) };
            let url = format!("sqlite:{slashes}{path}{query}");
            let parsed = SqliteOptions::from_url(&url).unwrap_or_else(|e| panic!("{url}: {e}"));
            prop_assert_eq!(parsed.path, PathBuf::from(&path));
            let durability = match modes.last() {
                Some(&"normal") => Durability::Normal,
                _ => Durability::Full,
            };
            prop_assert_eq!(parsed.durability, durability);
        }
    }

    /// A statement taken from the cache again runs as it was compiled: a join on a bound id,
    /// like the step commit's read, is not parsed and planned anew on each use.
    #[test]
    fn a_cached_statement_is_not_compiled_again_for_new_bindings() {
        let dir = tempfile::tempdir().unwrap();
        let conn = open_connection(&dir.path().join("r.db"), false).unwrap();
        conn.execute_batch(
            "CREATE TABLE a (id TEXT PRIMARY KEY, b_id TEXT NOT NULL, n INTEGER NOT NULL);
             CREATE TABLE b (id TEXT PRIMARY KEY, m INTEGER NOT NULL);
             CREATE TABLE c (a_id TEXT NOT NULL, k INTEGER NOT NULL, PRIMARY KEY (a_id, k)) WITHOUT ROWID;
             INSERT INTO b VALUES ('b1', 7);
             INSERT INTO a VALUES ('a1', 'b1', 1), ('a2', 'b1', 2);
             INSERT INTO c VALUES ('a1', 1), ('a2', 2);",
        )
        .unwrap();
        let sql = "SELECT a.n, b.m, (SELECT k FROM c WHERE a_id = ?1 AND k = ?2)
                   FROM a JOIN b ON b.id = a.b_id WHERE a.id = ?1";
        let configs = Configs::default();
        let tx = Tx {
            conn: &conn,
            configs: &configs,
        };
        for (id, k) in [("a1", 1_i64), ("a2", 2), ("a1", 1), ("a2", 5)] {
            let rows = tx.query(sql, &ratchet_store_sql::params![id, k]).unwrap();
            assert_eq!(rows.len(), 1);
        }
        let compiled_again = conn
            .prepare_cached(sql)
            .unwrap()
            .get_status(rusqlite::StatementStatus::RePrepare);
        assert_eq!(
            compiled_again, 0,
            "expected the cached statement to keep its plan across four bindings"
        );
    }
}
