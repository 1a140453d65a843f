//! One pooled connection, and the transaction on it as the shared bodies see it
//! (`ratchet_sql::Db`): `?N` parameters become `$N`, each statement is prepared once per
//! connection, and values cross as the few kinds the bodies know (integer, real, text, null).
//!
//! A transaction here never outlives its body and is never retried.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};

use bytes::BytesMut;
use postgres::types::{IsNull, ToSql, Type, to_sql_checked};
use postgres::{Client, Statement};
use ratchet_sql::{Announcement, Configs, Db, Param, Row, Value};
use ratchet_store::Error;

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

/// A connection and the statements prepared on it, keyed by the bodies' own SQL.
pub(crate) struct Conn {
    client: Client,
    statements: HashMap<String, Statement>,
    /// Set when a transaction could not be ended: what state the session is in is unknown.
    broken: bool,
}

impl Conn {
    pub(crate) fn new(client: Client) -> Conn {
        Conn {
            client,
            statements: HashMap::new(),
            broken: false,
        }
    }

    /// Whether the connection can serve another transaction.
    pub(crate) fn is_reusable(&self) -> bool {
        !self.broken && !self.client.is_closed()
    }

    /// Starts the transaction `run` runs a body in.
    pub(crate) fn begin(&mut self, access: Access) -> Result<()> {
        self.client
            .batch_execute(access.begin())
            .map_err(|e| backend_error(&e))
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
            Ok(value) => match self.client.batch_execute("COMMIT") {
                Ok(()) => {
                    self.notify(&announced);
                    Ok(value)
                }
                // The server may have committed before the connection went: only the
                // database can tell now.
                Err(error) if self.client.is_closed() => Err(Error::Backend(format!(
                    "the connection was lost while committing, so whether the write was kept \
                     is unknown ({})",
                    describe(&error)
                ))),
                // Any other failed COMMIT has ended the transaction, keeping nothing.
                Err(error) => Err(backend_error(&error)),
            },
            Err(error) => {
                if self.client.batch_execute("ROLLBACK").is_err() {
                    self.broken = true;
                }
                Err(error)
            }
        }
    }

    /// Tells other processes what the transaction that just committed did. Sent after its
    /// `COMMIT` rather than inside it: PostgreSQL serialises the commits of transactions that
    /// notify (a global lock held through their WAL flush), which would make every step commit
    /// wait for the one before it. This transaction writes nothing durable, so it commits
    /// without waiting for the disk. A notification lost here (the process dying between the
    /// two) costs the listeners latency only: they poll.
    fn notify(&mut self, announced: &[(&'static str, String)]) {
        if announced.is_empty() {
            return;
        }
        let calls: Vec<String> = announced
            .iter()
            .map(|(channel, payload)| {
                format!("pg_notify('{channel}', '{}')", payload.replace('\'', "''"))
            })
            .collect();
        let sql = format!(
            "BEGIN; SET LOCAL synchronous_commit TO off; SELECT {}; COMMIT",
            calls.join(", ")
        );
        if let Err(error) = self.client.batch_execute(&sql) {
            tracing::warn!(error = %describe(&error), "cannot notify other processes of a commit; they will find it by polling");
            if self.client.batch_execute("ROLLBACK").is_err() {
                self.broken = true;
            }
        }
    }

    /// After a body went on past a failed statement: whether the transaction is still
    /// valid (the body rolled back to a savepoint) or was aborted by the failure. PostgreSQL
    /// answers the `COMMIT` of an aborted transaction with a silent rollback, which must not
    /// reach the caller as a success.
    fn still_valid(&mut self) -> Result<()> {
        self.client.batch_execute("SELECT 1").map_err(|e| {
            Error::Backend(format!(
                "a statement of this transaction failed and aborted it, yet the operation went \
                 on as if it had not; nothing was kept ({})",
                describe(&e)
            ))
        })
    }

    fn statement(&mut self, sql: &str) -> std::result::Result<Statement, postgres::Error> {
        if let Some(statement) = self.statements.get(sql) {
            return Ok(statement.clone());
        }
        let statement = self.client.prepare(&dollar_parameters(sql))?;
        if self.statements.len() >= MAX_CACHED_STATEMENTS {
            self.statements.clear();
        }
        self.statements.insert(sql.to_owned(), statement.clone());
        Ok(statement)
    }
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
    /// Prepares (or reuses) `sql` and runs `run` with it and the bound parameters.
    fn with_statement<T>(
        &self,
        sql: &str,
        params: &[Param<'_>],
        run: impl FnOnce(
            &mut Client,
            &Statement,
            &[&(dyn ToSql + Sync)],
        ) -> std::result::Result<T, postgres::Error>,
    ) -> Result<T> {
        let binds: Vec<Bind<'_>> = params.iter().copied().map(Bind).collect();
        let refs: Vec<&(dyn ToSql + Sync)> =
            binds.iter().map(|b| b as &(dyn ToSql + Sync)).collect();
        let mut conn = self.conn.borrow_mut();
        let outcome = conn
            .statement(sql)
            .and_then(|statement| run(&mut conn.client, &statement, &refs));
        outcome.map_err(|error| {
            self.failed.set(true);
            Error::Backend(format!("{}; in `{}`", describe(&error), one_line(sql)))
        })
    }
}

impl Db for Tx<'_> {
    fn execute(&self, sql: &str, params: &[Param<'_>]) -> Result<u64> {
        self.with_statement(sql, params, |client, statement, params| {
            client.execute(statement, params)
        })
    }

    fn query(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>> {
        let rows = self.with_statement(sql, params, |client, statement, params| {
            client.query(statement, params)
        })?;
        rows.iter().map(row).collect()
    }

    fn lock_session(&self, session_id: &str) -> Result<()> {
        self.execute(
            "SELECT 1 FROM sessions WHERE id = COALESCE((SELECT root_session_id FROM sessions WHERE id = ?1), ?1) FOR UPDATE",
            &[Param::from(session_id)],
        )
        .map(|_| ())
    }

    fn lock_session_of_run(&self, run_id: &str) -> Result<()> {
        self.execute(
            "SELECT 1 FROM sessions WHERE id = (SELECT COALESCE(s.root_session_id, s.id) FROM runs r JOIN sessions s ON s.id = r.session_id WHERE r.id = ?1) FOR UPDATE",
            &[Param::from(run_id)],
        )
        .map(|_| ())
    }

    fn lock_run_quota(&self) -> Result<()> {
        self.execute(
            &format!("SELECT pg_advisory_xact_lock({RUN_QUOTA_LOCK})"),
            &[],
        )
        .map(|_| ())
    }

    fn skip_locked(&self) -> &'static str {
        " FOR UPDATE SKIP LOCKED"
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

fn row(row: &postgres::Row) -> Result<Row> {
    (0..row.len())
        .map(|index| value(row, index))
        .collect::<Result<Vec<Value>>>()
        .map(Row::new)
}

/// A column's value as one of the kinds the bodies read. Any other type is refused rather
/// than guessed at: the statement should cast it.
fn value(row: &postgres::Row, index: usize) -> Result<Value> {
    let column = &row.columns()[index];
    let ty = column.type_();
    let read = |error: postgres::Error| {
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
