//! The connection owners: one writer thread that group-commits every write that arrives
//! together into one transaction, and a small pool of read connections.
//!
//! Only the writer thread ever writes. Each operation runs inside its own savepoint, so one
//! failing operation rolls back alone while the batch commits; every caller hears back only
//! after the batch's `COMMIT` has returned (and so, with `synchronous=FULL`, is durable).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, mpsc};

use rusqlite::Connection;
use tokio::sync::oneshot;

use crate::{Configs, Result, Tx, backend};
use ratchet_store::Error;

/// Most operations folded into one transaction.
const MAX_BATCH: usize = 512;

trait WriteOp: Send {
    fn apply(&mut self, tx: &Tx<'_>);
    fn finish(self: Box<Self>, committed: Result<()>);
}

struct PendingOp<R, F> {
    body: Option<F>,
    result: Option<Result<R>>,
    reply: oneshot::Sender<Result<R>>,
}

impl<R, F> WriteOp for PendingOp<R, F>
where
    R: Send,
    F: FnOnce(&Tx<'_>) -> Result<R> + Send,
{
    fn apply(&mut self, tx: &Tx<'_>) {
        let Some(body) = self.body.take() else { return };
        self.result = Some(in_savepoint(tx, body));
    }

    fn finish(self: Box<Self>, committed: Result<()>) {
        let outcome = match committed {
            Ok(()) => self
                .result
                .unwrap_or_else(|| Err(Error::Backend("write was never applied".into()))),
            Err(error) => Err(error),
        };
        let _ = self.reply.send(outcome);
    }
}

fn in_savepoint<R>(tx: &Tx<'_>, body: impl FnOnce(&Tx<'_>) -> Result<R>) -> Result<R> {
    let conn = tx.conn;
    conn.prepare_cached("SAVEPOINT op")
        .and_then(|mut s| s.execute([]))
        .map_err(backend)?;
    let outcome = catch_unwind(AssertUnwindSafe(|| body(tx))).unwrap_or_else(|_| {
        Err(Error::Backend(
            "a store operation panicked; it was rolled back".into(),
        ))
    });
    let end = if outcome.is_ok() {
        "RELEASE op"
    } else {
        "ROLLBACK TO op"
    };
    conn.prepare_cached(end)
        .and_then(|mut s| s.execute([]))
        .map_err(backend)?;
    if outcome.is_err() {
        conn.prepare_cached("RELEASE op")
            .and_then(|mut s| s.execute([]))
            .map_err(backend)?;
    }
    outcome
}

/// Handle to the writer thread. Dropping every handle ends the thread.
#[derive(Clone)]
pub(crate) struct Writer {
    ops: mpsc::Sender<Box<dyn WriteOp>>,
}

impl Writer {
    pub(crate) fn spawn(conn: Connection, configs: Arc<Configs>) -> std::io::Result<Writer> {
        let (ops, inbox) = mpsc::channel::<Box<dyn WriteOp>>();
        std::thread::Builder::new()
            .name("ratchet-sqlite-writer".into())
            .spawn(move || {
                write_loop(
                    Tx {
                        conn: &conn,
                        configs: &configs,
                    },
                    inbox,
                )
            })?;
        Ok(Writer { ops })
    }

    pub(crate) async fn write<R, F>(&self, body: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&Tx<'_>) -> Result<R> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let op = Box::new(PendingOp {
            body: Some(body),
            result: None,
            reply,
        });
        self.ops
            .send(op)
            .map_err(|_| Error::Backend("the SQLite writer has stopped".into()))?;
        answer
            .await
            .map_err(|_| Error::Backend("the SQLite writer dropped a write".into()))?
    }
}

fn write_loop(tx: Tx<'_>, inbox: mpsc::Receiver<Box<dyn WriteOp>>) {
    let mut batch: Vec<Box<dyn WriteOp>> = Vec::with_capacity(MAX_BATCH);
    while let Ok(first) = inbox.recv() {
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match inbox.try_recv() {
                Ok(op) => batch.push(op),
                Err(_) => break,
            }
        }
        let committed = run_batch(&tx, &mut batch);
        for op in batch.drain(..) {
            op.finish(
                committed
                    .as_ref()
                    .map(|_| ())
                    .map_err(|e| Error::Backend(e.to_string())),
            );
        }
    }
}

fn run_batch(tx: &Tx<'_>, batch: &mut [Box<dyn WriteOp>]) -> Result<()> {
    let conn = tx.conn;
    conn.prepare_cached("BEGIN IMMEDIATE")
        .and_then(|mut s| s.execute([]))
        .map_err(backend)?;
    for op in batch.iter_mut() {
        op.apply(tx);
    }
    let committed = conn
        .prepare_cached("COMMIT")
        .and_then(|mut s| s.execute([]));
    if let Err(error) = committed {
        let _ = conn.execute_batch("ROLLBACK");
        return Err(backend(error));
    }
    Ok(())
}

/// Read connections, opened on demand and reused. Reads never block the writer (WAL).
pub(crate) struct Readers {
    path: PathBuf,
    configs: Arc<Configs>,
    idle: Mutex<Vec<Connection>>,
}

impl Readers {
    pub(crate) fn new(path: PathBuf, configs: Arc<Configs>) -> Arc<Readers> {
        Arc::new(Readers {
            path,
            configs,
            idle: Mutex::new(Vec::new()),
        })
    }

    pub(crate) async fn read<R, F>(self: &Arc<Self>, body: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&Tx<'_>) -> Result<R> + Send + 'static,
    {
        let readers = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            let conn = match readers.idle.lock().map_err(|_| poisoned())?.pop() {
                Some(conn) => conn,
                None => crate::open_connection(&readers.path, true)?,
            };
            let outcome = catch_unwind(AssertUnwindSafe(|| {
                body(&Tx {
                    conn: &conn,
                    configs: &readers.configs,
                })
            }))
            .unwrap_or_else(|_| Err(Error::Backend("a store read panicked".into())));
            readers.idle.lock().map_err(|_| poisoned())?.push(conn);
            outcome
        })
        .await
        .map_err(|e| Error::Backend(format!("read task failed: {e}")))?
    }
}

fn poisoned() -> Error {
    Error::Backend("reader pool lock poisoned".into())
}
