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
    run(tx, "SAVEPOINT op")?;
    let outcome = catch_unwind(AssertUnwindSafe(|| body(tx))).unwrap_or_else(|_| {
        Err(Error::Backend(
            "a store operation panicked; it was rolled back".into(),
        ))
    });
    if tx.is_autocommit() {
        // SQLite itself rolled the whole transaction back (disk full, I/O error): there is
        // no savepoint left to end, and the batch is lost.
        return outcome;
    }
    match outcome {
        Ok(value) => run(tx, "RELEASE op").map(|()| value),
        Err(error) => {
            run(tx, "ROLLBACK TO op")?;
            run(tx, "RELEASE op")?;
            Err(error)
        }
    }
}

fn run(tx: &Tx<'_>, sql: &str) -> Result<()> {
    tx.prepare_cached(sql)
        .and_then(|mut s| s.execute([]))
        .map_err(backend)?;
    Ok(())
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
        metrics::histogram!("ratchet_store_commit_batch_size").record(batch.len() as f64);
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
    run(tx, "BEGIN IMMEDIATE")?;
    for op in batch.iter_mut() {
        op.apply(tx);
        if tx.is_autocommit() {
            // The transaction is gone: applying the rest would commit each of them on its
            // own, behind the callers' backs. Nothing of this batch is durable.
            return Err(Error::Backend(
                "SQLite rolled the transaction back; no write of this batch was kept".into(),
            ));
        }
    }
    if let Err(error) = run(tx, "COMMIT") {
        let _ = tx.execute_batch("ROLLBACK");
        return Err(error);
    }
    Ok(())
}

/// Read connections at once, at most. More would only queue on two cores' worth of blocking
/// threads, and each idle one keeps its own page cache: a burst of readers (a hundred event
/// streams) waits its turn instead of opening a connection apiece and keeping them all.
const MAX_READERS: usize = 8;

/// Read connections, opened on demand and reused, `MAX_READERS` at most. Reads never block
/// the writer (WAL).
pub(crate) struct Readers {
    path: PathBuf,
    configs: Arc<Configs>,
    idle: Mutex<Vec<Connection>>,
    turns: tokio::sync::Semaphore,
}

impl Readers {
    pub(crate) fn new(path: PathBuf, configs: Arc<Configs>) -> Arc<Readers> {
        Arc::new(Readers {
            path,
            configs,
            idle: Mutex::new(Vec::new()),
            turns: tokio::sync::Semaphore::new(MAX_READERS),
        })
    }

    /// Connections open now, in use or idle; never more than `MAX_READERS`.
    #[cfg(test)]
    pub(crate) fn idle_connections(&self) -> usize {
        self.idle.lock().map_or(0, |idle| idle.len())
    }

    pub(crate) async fn read<R, F>(self: &Arc<Self>, body: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&Tx<'_>) -> Result<R> + Send + 'static,
    {
        let turn = self
            .turns
            .acquire()
            .await
            .map_err(|_| Error::Backend("the reader pool is closed".into()))?;
        let readers = Arc::clone(self);
        let read = tokio::task::spawn_blocking(move || {
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
        .await;
        drop(turn);
        read.map_err(|e| Error::Backend(format!("read task failed: {e}")))?
    }
}

fn poisoned() -> Error {
    Error::Backend("reader pool lock poisoned".into())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A burst of concurrent reads (a hundred event streams catching up at once) takes turns
    /// on a few connections instead of opening one each and keeping them all afterwards.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_burst_of_reads_opens_at_most_max_readers_connections() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.db");
        crate::open_connection(&path, false)
            .unwrap()
            .execute_batch("PRAGMA journal_mode = WAL; CREATE TABLE t (v INTEGER);")
            .unwrap();
        let readers = Readers::new(path, Arc::default());
        let reads: Vec<_> = (0..64)
            .map(|_| {
                let readers = Arc::clone(&readers);
                tokio::spawn(async move {
                    readers
                        .read(|tx| {
                            std::thread::sleep(Duration::from_millis(20));
                            tx.query_row("SELECT count(*) FROM t", [], |r| r.get::<_, i64>(0))
                                .map_err(backend)
                        })
                        .await
                })
            })
            .collect();
        for read in reads {
            assert_eq!(read.await.unwrap().unwrap(), 0);
        }
        let open = readers.idle_connections();
        assert!(
            (1..=MAX_READERS).contains(&open),
            "expected 1 to {MAX_READERS} connections kept after 64 concurrent reads, found {open}"
        );
    }

    /// When SQLite rolls a whole batch back by itself (here: the database is full), no write
    /// of the batch may survive, and every caller hears that it failed.
    #[tokio::test]
    async fn a_batch_rolled_back_by_sqlite_keeps_nothing_and_fails_every_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("full.db");
        let conn = crate::open_connection(&path, false).unwrap();
        conn.execute_batch("PRAGMA journal_mode = WAL; CREATE TABLE t (v BLOB);")
            .unwrap();
        let pages: i64 = conn
            .query_row("PRAGMA page_count", [], |r| r.get(0))
            .unwrap();
        conn.pragma_update(None, "max_page_count", pages + 2)
            .unwrap();
        let writer = Writer::spawn(conn, Arc::default()).unwrap();

        let insert = |bytes: usize| {
            move |tx: &Tx<'_>| {
                tx.execute("INSERT INTO t (v) VALUES (?1)", [vec![7u8; bytes]])
                    .map(|_| ())
                    .map_err(backend)
            }
        };
        // The first write holds the writer until the next three have queued up, in order, into
        // one batch: each is polled once (which sends it to the writer) while the first runs.
        let (entered, running) = tokio::sync::oneshot::channel();
        let (release, held) = std::sync::mpsc::channel::<()>();
        let mut gate = std::pin::pin!(writer.write(move |_: &Tx<'_>| {
            entered.send(()).expect("the test waits for the gate");
            held.recv().expect("the test releases the gate");
            Ok(())
        }));
        let mut small = std::pin::pin!(writer.write(insert(10)));
        let mut huge = std::pin::pin!(writer.write(insert(1_000_000)));
        let mut after = std::pin::pin!(writer.write(insert(10)));
        let queued = std::future::poll_fn(|cx| {
            assert!(
                gate.as_mut().poll(cx).is_pending(),
                "the gate waits for its release"
            );
            std::task::Poll::Ready(())
        });
        queued.await;
        running.await.unwrap();
        std::future::poll_fn(|cx| {
            for write in [small.as_mut(), huge.as_mut(), after.as_mut()] {
                assert!(write.poll(cx).is_pending(), "queued behind the gate");
            }
            std::task::Poll::Ready(())
        })
        .await;
        release.send(()).unwrap();
        let (gate, small, huge, after) = tokio::join!(gate, small, huge, after);
        gate.unwrap();
        assert!(huge.is_err(), "the write that filled the disk failed");
        assert!(
            small.is_err() && after.is_err(),
            "{small:?} {after:?}: their batch was lost"
        );
        let check = crate::open_connection(&path, true).unwrap();
        let rows: i64 = check
            .query_row("SELECT count(*) FROM t", [], |r| r.get(0))
            .unwrap();
        assert_eq!(
            rows, 0,
            "nothing of the lost batch was committed behind the callers' backs"
        );
        let next = writer.write(insert(10)).await;
        assert!(
            next.is_ok(),
            "the writer goes on after a lost batch: {next:?}"
        );
    }
}
