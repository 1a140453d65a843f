//! One pooled connection, and the transaction on it as the shared bodies see it
//! (`ratchet_store_sql::Db`): `?N` parameters become `$N`, each statement is prepared once per
//! connection, and values cross as the few kinds the bodies know (integer, real, text, null).
//!
//! Round trips are what a transaction costs across a network, so statements are pipelined:
//! `BEGIN`, the session locks and every `Db::write` are held back and sent with the next
//! statement that must answer (a query, an `execute`), or with the `COMMIT`, which itself goes
//! out in one flight with the writes before it and the notifications after it. The server
//! runs them in the order they were issued either way; the first that fails fails the
//! transaction, which then keeps nothing.
//!
//! A transaction here never outlives its body and is never retried.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;

use bytes::BytesMut;
use futures::future::{MaybeDone, maybe_done};
use postgres::Statement;
use postgres::types::{IsNull, ToSql, Type, to_sql_checked};
use ratchet_store::Error;
use ratchet_store_sql::{Announcement, Configs, Db, Param, Row, Value};
use tokio_postgres::Client;

use crate::{Result, backend_error, changes, describe};

/// Most statements kept prepared on one connection; past this the cache starts over. The
/// bodies' statements are a fixed set well below it.
const MAX_CACHED_STATEMENTS: usize = 512;

/// What a transaction may do, and what it sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Each statement sees what was committed before it started; the bodies' row locks
    /// (`lock_session`, claims) order concurrent writers.
    Write,
    /// One snapshot for every statement, so a read of several statements is consistent.
    Read,
}

impl Access {
    fn begin(self) -> &'static str {
        match self {
            Access::Write => "BEGIN ISOLATION LEVEL READ COMMITTED",
            Access::Read => "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY",
        }
    }
}

/// A parameter owned by a statement that waits to be sent.
#[derive(Debug, Clone)]
enum Owned {
    Int(Option<i64>),
    Real(Option<f64>),
    Text(Option<String>),
}

impl Owned {
    fn of(param: Param<'_>) -> Owned {
        match param {
            Param::Int(value) => Owned::Int(value),
            Param::Real(value) => Owned::Real(value),
            Param::Text(value) => Owned::Text(value.map(str::to_owned)),
        }
    }

    fn param(&self) -> Param<'_> {
        match self {
            Owned::Int(value) => Param::Int(*value),
            Owned::Real(value) => Param::Real(*value),
            Owned::Text(value) => Param::Text(value.as_deref()),
        }
    }
}

/// A statement held back until the next round trip.
enum Held {
    /// Transaction control, sent as a simple query.
    Control(&'static str),
    Write {
        sql: String,
        statement: Statement,
        params: Vec<Owned>,
    },
}

impl Held {
    fn sql(&self) -> &str {
        match self {
            Held::Control(sql) => sql,
            Held::Write { sql, .. } => sql,
        }
    }
}

type Sent<'a, T> =
    Pin<Box<dyn Future<Output = std::result::Result<T, tokio_postgres::Error>> + 'a>>;

/// A connection and the statements prepared on it, keyed by the bodies' own SQL. It drives
/// its own single-threaded runtime, only while a call of its waits for the server.
pub(crate) struct Conn {
    runtime: tokio::runtime::Runtime,
    client: Client,
    statements: HashMap<String, Statement>,
    /// Statements issued and not yet sent, in their order.
    held: Vec<Held>,
    /// Set when a transaction could not be ended: what state the session is in is unknown.
    broken: bool,
}

impl Conn {
    pub(crate) fn new(runtime: tokio::runtime::Runtime, client: Client) -> Conn {
        Conn {
            runtime,
            client,
            statements: HashMap::new(),
            held: Vec::new(),
            broken: false,
        }
    }

    /// Whether the connection can serve another transaction.
    pub(crate) fn is_reusable(&self) -> bool {
        !self.broken && !self.client.is_closed()
    }

    /// Starts the transaction `run` runs a body in; its `BEGIN` goes out with the body's
    /// first statement. A connection the server closed while it sat idle (a restart, an idle
    /// timeout) fails here, before any of the body runs: the server said so on the socket, and
    /// letting the connection's task read it costs no round trip.
    pub(crate) fn begin(&mut self, access: Access) -> Result<()> {
        self.runtime.block_on(async {
            for _ in 0..2 {
                tokio::task::yield_now().await;
            }
        });
        if self.client.is_closed() {
            return Err(Error::Backend(
                "the connection to PostgreSQL was closed while idle".into(),
            ));
        }
        self.held.push(Held::Control(access.begin()));
        Ok(())
    }

    /// Runs `body` in the transaction `begin` started, which commits when the body returns
    /// `Ok` and keeps nothing otherwise, a panic included.
    pub(crate) fn run<R>(
        &mut self,
        origin: &str,
        configs: &Configs,
        body: impl FnOnce(&dyn Db) -> Result<R>,
    ) -> Result<R> {
        let (outcome, failed, announced) = {
            let tx = Tx {
                conn: RefCell::new(&mut *self),
                origin,
                configs,
                failed: Cell::new(false),
                announced: RefCell::new(Vec::new()),
            };
            let outcome = catch_unwind(AssertUnwindSafe(|| body(&tx))).unwrap_or_else(|_| {
                Err(Error::Backend(
                    "a store operation panicked; it was rolled back".into(),
                ))
            });
            (outcome, tx.failed.get(), tx.announced.into_inner())
        };
        let outcome = match outcome {
            Ok(value) if failed => self.still_valid().map(|()| value),
            other => other,
        };
        match outcome {
            Ok(value) => self.commit(&announced).map(|()| value),
            Err(error) => {
                // A body that failed before its first round trip has sent nothing, not even
                // its BEGIN; otherwise the rollback ends whatever was sent.
                let sent = !matches!(self.held.first(), Some(Held::Control(sql)) if sql.starts_with("BEGIN"));
                self.held.clear();
                if sent
                    && self
                        .runtime
                        .block_on(self.client.batch_execute("ROLLBACK"))
                        .is_err()
                {
                    self.broken = true;
                }
                Err(error)
            }
        }
    }

    /// Sends what is held back, the `COMMIT` and the notifications in one flight.
    ///
    /// The notifications go in a transaction of their own after the `COMMIT`: PostgreSQL
    /// serialises the commits of transactions that notify (a global lock held through their
    /// WAL flush), which would make every step commit wait for the one before it. That
    /// transaction writes nothing durable, so it commits without waiting for the disk. A
    /// notification after a commit that failed tells listeners of nothing new; one lost costs
    /// them latency only: they poll.
    fn commit(&mut self, announced: &[(&'static str, String)]) -> Result<()> {
        self.held.push(Held::Control("COMMIT"));
        let commit_at = self.held.len() - 1;
        let notify = notify_sql(announced);
        let client = &self.client;
        let notified = async {
            match &notify {
                Some(sql) => client.batch_execute(sql).await,
                None => Ok(()),
            }
        };
        let sending = std::mem::take(&mut self.held);
        let (written, notified) = self
            .runtime
            .block_on(send_in_order(client, &sending, notified));
        if let Err(error) = notified {
            tracing::warn!(error = %describe(&error), "cannot notify other processes of a commit; they will find it by polling");
        }
        match written {
            Ok(()) => Ok(()),
            // The server may have committed before the connection went: only the database
            // can tell now.
            Err((at, error)) if at == commit_at && self.client.is_closed() => {
                self.broken = true;
                Err(Error::Backend(format!(
                    "the connection was lost while committing, so whether the write was kept is \
                     unknown ({})",
                    describe(&error)
                )))
            }
            // Any other failed COMMIT has ended the transaction, keeping nothing.
            Err((at, error)) if at == commit_at => Err(backend_error(&error)),
            // After a held write failed, the server ended the aborted transaction at the
            // COMMIT, keeping nothing.
            Err((at, error)) => Err(failed_statement(sending[at].sql(), &error)),
        }
    }

    /// After a body went on past a failed statement: whether the transaction is still
    /// valid (the body rolled back to a savepoint) or was aborted by the failure. PostgreSQL
    /// answers the `COMMIT` of an aborted transaction with a silent rollback, which must not
    /// reach the caller as a success.
    fn still_valid(&mut self) -> Result<()> {
        let client = &self.client;
        let (written, answered) = flight(
            &self.runtime,
            client,
            &mut self.held,
            client.batch_execute("SELECT 1"),
        );
        written
            .and_then(|()| answered.map_err(|e| backend_error(&e)))
            .map_err(|e| {
                Error::Backend(format!(
                    "a statement of this transaction failed and aborted it, yet the operation went \
                 on as if it had not; nothing was kept ({e})"
                ))
            })
    }

    fn statement(&mut self, sql: &str) -> std::result::Result<Statement, tokio_postgres::Error> {
        if let Some(statement) = self.statements.get(sql) {
            return Ok(statement.clone());
        }
        let statement = self
            .runtime
            .block_on(self.client.prepare(&dollar_parameters(sql)))?;
        if self.statements.len() >= MAX_CACHED_STATEMENTS {
            self.statements.clear();
        }
        self.statements.insert(sql.to_owned(), statement.clone());
        Ok(statement)
    }
}

/// Sends the held statements, then `last`, in one flight on `runtime`, and empties `held`.
/// Returns the first held statement's failure, if one failed (the ones after it were refused
/// by the aborted transaction), and `last`'s answer.
fn flight<T>(
    runtime: &tokio::runtime::Runtime,
    client: &Client,
    held: &mut Vec<Held>,
    last: impl Future<Output = T>,
) -> (Result<()>, T) {
    let sending = std::mem::take(held);
    let (written, answer) = runtime.block_on(send_in_order(client, &sending, last));
    let written = written.map_err(|(index, error)| failed_statement(sending[index].sql(), &error));
    (written, answer)
}

/// Sends every held statement, then `last`, without waiting for any answer in between:
/// each request goes out when its future is first polled, and they are polled in order.
/// Returns the index and error of the first held statement that failed (the ones after it
/// were refused by the aborted transaction), and `last`'s own answer.
async fn send_in_order<'a, T>(
    client: &'a Client,
    held: &'a [Held],
    last: impl Future<Output = T> + 'a,
) -> (std::result::Result<(), (usize, tokio_postgres::Error)>, T) {
    let binds: Vec<Vec<Bind<'_>>> = held
        .iter()
        .map(|held| match held {
            Held::Control(_) => Vec::new(),
            Held::Write { params, .. } => params.iter().map(|p| Bind(p.param())).collect(),
        })
        .collect();
    let refs: Vec<Vec<&(dyn ToSql + Sync)>> = binds
        .iter()
        .map(|binds| binds.iter().map(|b| b as &(dyn ToSql + Sync)).collect())
        .collect();
    let mut sent: Vec<MaybeDone<Sent<'_, ()>>> = held
        .iter()
        .zip(&refs)
        .map(|(held, params)| {
            let future: Sent<'_, ()> = match held {
                Held::Control(sql) => Box::pin(client.batch_execute(sql)),
                Held::Write { statement, .. } => {
                    Box::pin(async move { client.execute(statement, params).await.map(|_| ()) })
                }
            };
            maybe_done(future)
        })
        .collect();
    for future in &mut sent {
        let _ = futures::poll!(future);
    }
    let answer = last.await;
    let mut first_failure = Ok(());
    for (index, future) in sent.iter_mut().enumerate() {
        (&mut *future).await;
        let outcome = Pin::new(future)
            .take_output()
            .expect("a finished future has its output");
        if let (Err(error), Ok(())) = (outcome, &first_failure) {
            first_failure = Err((index, error));
        }
    }
    (first_failure, answer)
}

/// The statement that tells other processes what a committed transaction did.
fn notify_sql(announced: &[(&'static str, String)]) -> Option<String> {
    if announced.is_empty() {
        return None;
    }
    let calls: Vec<String> = announced
        .iter()
        .map(|(channel, payload)| {
            format!("pg_notify('{channel}', '{}')", payload.replace('\'', "''"))
        })
        .collect();
    Some(format!(
        "BEGIN; SET LOCAL synchronous_commit TO off; SELECT {}; COMMIT",
        calls.join(", ")
    ))
}

/// The open transaction handed to a body.
struct Tx<'a> {
    conn: RefCell<&'a mut Conn>,
    origin: &'a str,
    configs: &'a Configs,
    /// Whether a statement failed: PostgreSQL then refuses every statement up to a
    /// `ROLLBACK` (to a savepoint, or of the whole transaction).
    failed: Cell<bool>,
    /// Notifications to send once the transaction has committed, each once.
    announced: RefCell<Vec<(&'static str, String)>>,
}

impl Tx<'_> {
    /// Sends what is held back and `sql` with `params` in one flight, and returns what `run`
    /// made of the answer.
    fn answered<T>(
        &self,
        sql: &str,
        params: &[Param<'_>],
        run: impl AsyncFnOnce(
            &Client,
            &Statement,
            &[&(dyn ToSql + Sync)],
        ) -> std::result::Result<T, tokio_postgres::Error>,
    ) -> Result<T> {
        let binds: Vec<Bind<'_>> = params.iter().copied().map(Bind).collect();
        let refs: Vec<&(dyn ToSql + Sync)> =
            binds.iter().map(|b| b as &(dyn ToSql + Sync)).collect();
        let mut conn = self.conn.borrow_mut();
        let statement = conn
            .statement(sql)
            .map_err(|error| self.failure(sql, &error))?;
        let conn = &mut **conn;
        let (written, answered) = flight(
            &conn.runtime,
            &conn.client,
            &mut conn.held,
            run(&conn.client, &statement, &refs),
        );
        written
            .inspect_err(|_| self.failed.set(true))
            .and_then(|()| answered.map_err(|error| self.failure(sql, &error)))
    }

    /// Holds `sql` back until the next round trip.
    fn hold(&self, sql: &str, params: &[Param<'_>]) -> Result<()> {
        let mut conn = self.conn.borrow_mut();
        let statement = conn
            .statement(sql)
            .map_err(|error| self.failure(sql, &error))?;
        conn.held.push(Held::Write {
            sql: sql.to_owned(),
            statement,
            params: params.iter().copied().map(Owned::of).collect(),
        });
        Ok(())
    }

    fn failure(&self, sql: &str, error: &tokio_postgres::Error) -> Error {
        self.failed.set(true);
        failed_statement(sql, error)
    }
}

impl Db for Tx<'_> {
    fn execute(&self, sql: &str, params: &[Param<'_>]) -> Result<u64> {
        self.answered(sql, params, async |client, statement, params| {
            client.execute(statement, params).await
        })
    }

    fn write(&self, sql: &str, params: &[Param<'_>]) -> Result<()> {
        self.hold(sql, params)
    }

    fn query(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>> {
        let rows = self.answered(sql, params, async |client, statement, params| {
            client.query(statement, params).await
        })?;
        rows.iter().map(row).collect()
    }

    fn lock_session(&self, session_id: &str) -> Result<()> {
        self.hold(
            "SELECT 1 FROM sessions WHERE id = COALESCE((SELECT root_session_id FROM sessions WHERE id = ?1), ?1) FOR UPDATE",
            &[Param::from(session_id)],
        )
    }

    fn lock_session_of_run(&self, run_id: &str) -> Result<()> {
        self.hold(
            "SELECT 1 FROM sessions WHERE id = (SELECT COALESCE(s.root_session_id, s.id) FROM runs r JOIN sessions s ON s.id = r.session_id WHERE r.id = ?1) FOR UPDATE",
            &[Param::from(run_id)],
        )
    }

    fn lock_run_quota(&self) -> Result<()> {
        self.hold(
            &format!("SELECT pg_advisory_xact_lock({RUN_QUOTA_LOCK})"),
            &[],
        )
    }

    fn skip_locked(&self) -> &'static str {
        " FOR UPDATE SKIP LOCKED"
    }

    fn for_update(&self) -> &'static str {
        " FOR UPDATE"
    }

    fn announce(&self, announcement: Announcement<'_>) -> Result<()> {
        let notification = changes::notification(self.origin, announcement);
        let mut announced = self.announced.borrow_mut();
        if !announced.contains(&notification) {
            announced.push(notification);
        }
        Ok(())
    }

    fn configs(&self) -> &Configs {
        self.configs
    }
}

/// The advisory lock global run-quota admissions take ("quota" in ASCII); the migrations'
/// lock is another key.
const RUN_QUOTA_LOCK: i64 = 0x0071_756f_7461;

/// The error of a statement that failed: what the server said, and which statement.
fn failed_statement(sql: &str, error: &tokio_postgres::Error) -> Error {
    Error::Backend(format!("{}; in `{}`", describe(error), one_line(sql)))
}

/// A statement, shortened to fit in an error message.
fn one_line(sql: &str) -> String {
    const MAX: usize = 120;
    let line = sql.split_whitespace().collect::<Vec<_>>().join(" ");
    match line.char_indices().nth(MAX) {
        Some((end, _)) => format!("{}…", &line[..end]),
        None => line,
    }
}

/// Rewrites SQLite-style `?N` parameters as PostgreSQL's `$N`, leaving quoted literals and
/// identifiers alone. A `?` not followed by a digit is PostgreSQL's own (a JSON operator).
pub(crate) fn dollar_parameters(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    let mut quote: Option<char> = None;
    while let Some(c) = chars.next() {
        match quote {
            // A doubled quote inside a literal closes and reopens it, which reads the same.
            Some(open) => {
                if c == open {
                    quote = None;
                }
                out.push(c);
            }
            None => match c {
                '\'' | '"' => {
                    quote = Some(c);
                    out.push(c);
                }
                '?' if chars.peek().is_some_and(char::is_ascii_digit) => out.push('$'),
                _ => out.push(c),
            },
        }
    }
    out
}

/// A parameter bound to whichever of its kind's types the server chose for it.
#[derive(Debug)]
struct Bind<'a>(Param<'a>);

impl ToSql for Bind<'_> {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> std::result::Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        let mismatch = |kind: &str| -> Box<dyn std::error::Error + Sync + Send> {
            format!("{kind} cannot be bound to a parameter of type {ty}").into()
        };
        match self.0 {
            Param::Int(None) | Param::Real(None) | Param::Text(None) => Ok(IsNull::Yes),
            Param::Int(Some(value)) => match *ty {
                Type::INT8 => value.to_sql(ty, out),
                Type::INT4 => i32::try_from(value)
                    .map_err(|_| format!("{value} does not fit a parameter of type {ty}"))?
                    .to_sql(ty, out),
                Type::INT2 => i16::try_from(value)
                    .map_err(|_| format!("{value} does not fit a parameter of type {ty}"))?
                    .to_sql(ty, out),
                _ => Err(mismatch("an integer")),
            },
            Param::Real(Some(value)) => match *ty {
                Type::FLOAT8 => value.to_sql(ty, out),
                Type::FLOAT4 => (value as f32).to_sql(ty, out),
                _ => Err(mismatch("a real number")),
            },
            // PostgreSQL text cannot hold a NUL; a model's or a tool's text that has one
            // must still commit (JSON columns escape it and are not affected).
            Param::Text(Some(value)) if value.contains('\0') => {
                Bind(Param::Text(Some(&value.replace('\0', "\u{FFFD}")))).to_sql(ty, out)
            }
            Param::Text(Some(value)) => match *ty {
                Type::TEXT | Type::VARCHAR => value.to_sql(ty, out),
                _ => Err(mismatch("text")),
            },
        }
    }

    fn accepts(ty: &Type) -> bool {
        matches!(
            *ty,
            Type::INT8
                | Type::INT4
                | Type::INT2
                | Type::FLOAT8
                | Type::FLOAT4
                | Type::TEXT
                | Type::VARCHAR
        )
    }

    to_sql_checked!();
}

fn row(row: &tokio_postgres::Row) -> Result<Row> {
    (0..row.len())
        .map(|index| value(row, index))
        .collect::<Result<Vec<Value>>>()
        .map(Row::new)
}

/// A column's value as one of the kinds the bodies read. Any other type is refused rather
/// than guessed at: the statement should cast it.
fn value(row: &tokio_postgres::Row, index: usize) -> Result<Value> {
    let column = &row.columns()[index];
    let ty = column.type_();
    let read = |error: tokio_postgres::Error| {
        Error::Backend(format!("cannot read column {}: {error}", column.name()))
    };
    let value = match *ty {
        Type::INT8 => row
            .try_get::<_, Option<i64>>(index)
            .map_err(read)?
            .map(Value::Int),
        Type::INT4 => row
            .try_get::<_, Option<i32>>(index)
            .map_err(read)?
            .map(|v| Value::Int(v.into())),
        Type::INT2 => row
            .try_get::<_, Option<i16>>(index)
            .map_err(read)?
            .map(|v| Value::Int(v.into())),
        Type::FLOAT8 => row
            .try_get::<_, Option<f64>>(index)
            .map_err(read)?
            .map(Value::Real),
        Type::FLOAT4 => row
            .try_get::<_, Option<f32>>(index)
            .map_err(read)?
            .map(|v| Value::Real(v.into())),
        Type::TEXT | Type::VARCHAR | Type::NAME => row
            .try_get::<_, Option<String>>(index)
            .map_err(read)?
            .map(Value::Text),
        Type::BOOL => row
            .try_get::<_, Option<bool>>(index)
            .map_err(read)?
            .map(|v| Value::Int(v.into())),
        _ => {
            return Err(Error::Backend(format!(
                "column {name} is of type {ty}, which the store does not read; expected bigint, \
                 double precision, text or boolean: cast it in the statement ({name}::bigint, \
                 {name}::float8 or {name}::text)",
                name = column.name()
            )));
        }
    };
    Ok(value.unwrap_or(Value::Null))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbered_parameters_become_dollar_parameters_outside_quotes() {
        assert_eq!(
            dollar_parameters("SELECT a FROM t WHERE b = ?1 AND c IN (?2, ?12) LIMIT ?3"),
            "SELECT a FROM t WHERE b = $1 AND c IN ($2, $12) LIMIT $3"
        );
        assert_eq!(
            dollar_parameters(r#"SELECT '?1', 'it''s ?2', "odd?3", ?4"#),
            r#"SELECT '?1', 'it''s ?2', "odd?3", $4"#
        );
        assert_eq!(
            dollar_parameters("SELECT j ? 'key', ?1"),
            "SELECT j ? 'key', $1"
        );
    }

    #[test]
    fn a_long_statement_is_shortened_for_errors() {
        assert_eq!(one_line("SELECT 1\n   FROM t"), "SELECT 1 FROM t");
        let long = one_line(&"x ".repeat(200));
        assert_eq!(long.chars().count(), 121);
        assert!(long.ends_with('…'));
    }
}
