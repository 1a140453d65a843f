//! `ratchet bench steps`: durable step throughput and latency on a real store.
//!
//! Each run is K round-trips (a model call answering one `add` call, then that tool batch)
//! and a final answer: 2K+1 durable steps. Step latency is measured as a client sees it:
//! the time between consecutive `step.committed` events of a run (the first from submit).
//!
//! Beside the steps it reports what bounds them and what they cost: on SQLite, the disk's own
//! rate of fsynced single-row commits, measured in the database's directory just before the
//! runs (steps/s ÷ commits/s shows what group commit gains); on every store, the bytes the
//! database grew by per committed step.

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ratchet_core::{Limits, RunStatus, SessionId};
use ratchet_engine::{Multitask, PoolConfig};
use ratchet_store::SessionSpec;
use serde_json::{Value, json};
use tokio::sync::{Semaphore, broadcast::error::RecvError, oneshot};

use ratchet::{
    Runtime, Schema, announces_changes, database_bytes, database_directory, open_sealed_store,
};

use crate::report::{
    percentile, print_report, process_memory_bytes, scratch_database, scripted_model,
    scripted_run_config, start_process,
};
use crate::webhooks::WebhookLoad;

/// How long one run may take before the benchmark gives up on it. Generous: at a thousand
/// runs at a time on a slow store, each run waits behind all the others.
const RUN_DEADLINE: Duration = Duration::from_secs(600);
/// How often the store is asked which runs ended, once the event bus may have dropped a
/// run's end (see `steps`).
const STORE_CHECK: Duration = Duration::from_millis(500);

#[derive(Debug, clap::Args)]
pub struct StepsArgs {
    /// Database URL; a fresh temporary SQLite file when absent.
    #[arg(long)]
    pub db: Option<String>,
    #[arg(long, default_value_t = 200)]
    pub runs: usize,
    #[arg(long, default_value_t = 100)]
    pub concurrency: usize,
    #[arg(long, default_value_t = 5)]
    pub turns: usize,
    /// Run the steps in this many `ratchet worker` processes on the same database instead
    /// of in this one (which then only submits and watches); needs a database that tells
    /// other processes of its changes (postgres://).
    #[arg(long, default_value_t = 0)]
    pub worker_processes: usize,
    /// Fsynced single-row commits measured in the database's directory before the runs,
    /// for the disk's own rate (SQLite only).
    #[arg(long, default_value_t = 1000)]
    pub commits: u32,
    /// A webhook receiving every event, from a receiver in this process that answers at
    /// once or never.
    #[arg(long, value_enum, default_value = "none")]
    pub webhook: WebhookLoad,
    /// The event kinds the webhook is sent, comma-separated (every kind when absent).
    #[arg(long, value_delimiter = ',')]
    pub webhook_events: Option<Vec<String>>,
    #[arg(long)]
    pub json: bool,
}

struct Watch {
    last: Instant,
    done: Option<oneshot::Sender<()>>,
}

pub async fn steps(args: StepsArgs) -> anyhow::Result<ExitCode> {
    if args.runs == 0 || args.concurrency == 0 || args.commits == 0 {
        bail!("--runs, --concurrency and --commits must be at least 1");
    }
    if args.concurrency > args.runs {
        bail!(
            "--concurrency {} is more than --runs {}: at most {} runs can be in flight at once",
            args.concurrency,
            args.runs,
            args.runs
        );
    }
    let (scratch, db) = scratch_database(args.db.as_deref())?;
    if args.worker_processes > 0 && !announces_changes(&db)? {
        bail!(
            "--worker-processes needs a database that tells other processes of its changes \
             (--db postgres://…): over SQLite this process would not hear of their steps"
        );
    }
    let mut replies: Vec<_> = (0..args.turns)
        .map(|i| json!({"tool_calls": [{"name": "add", "arguments": {"a": i, "b": 1}}]}))
        .collect();
    replies.push(json!({"text": "done"}));
    let model = scripted_model(scratch.path(), Value::Array(replies))?;
    // Room for every round-trip without the budget forcing a concluding call.
    let limits = Limits {
        max_steps: 2 * args.turns as u64 + 3,
        ..Limits::default()
    };
    let (toolbox, config) = scripted_run_config(model, limits)?;
    // The disk's limit, on the disk the steps will wait on, just before they do.
    let commits_per_s = match database_directory(&db)? {
        Some(directory) => {
            let probe = tempfile::tempdir_in(&directory).with_context(|| {
                format!(
                    "cannot create a scratch directory in {}",
                    directory.display()
                )
            })?;
            Some(ratchet_sqlite::single_commit_rate(
                probe.path(),
                args.commits,
            )?)
        }
        None => None,
    };
    // A key of this run alone: the benchmark's webhook lives no longer than the run.
    let keyring = ratchet_store::Keyring::new(ratchet_store::Key::generate()?, Vec::new())?;
    let runtime = Runtime::new(open_sealed_store(&db, Schema::Migrate, keyring)?, toolbox);
    let bytes_before = database_bytes(&db)?;
    let coordinator = Arc::clone(&runtime.coordinator);
    let observer = crate::webhooks::attach(
        args.webhook,
        args.webhook_events.clone(),
        runtime.webhooks.as_ref(),
        Arc::clone(&runtime.deliveries),
    )
    .await?;
    let pool = (args.worker_processes == 0).then(|| {
        runtime.start_workers(PoolConfig {
            workers: args.concurrency,
            ..PoolConfig::default()
        })
    });
    let mut workers = Vec::with_capacity(args.worker_processes);
    for _ in 0..args.worker_processes {
        let concurrency = args.concurrency.to_string();
        let (worker, _) = start_process(
            "worker",
            &["worker", "--db", &db, "--workers", &concurrency],
            "ratchet worker on database",
        )
        .await?;
        workers.push(worker);
    }

    let watches: Arc<std::sync::Mutex<HashMap<SessionId, Watch>>> = Arc::default();
    let latencies: Arc<std::sync::Mutex<Vec<Duration>>> = Arc::default();
    // Set once the bus may have dropped a run's end, and from the start when other processes
    // run the steps (their events reach this one through a relay that may drop some): from
    // then on, the sweeper below asks the store.
    let missed = Arc::new(AtomicBool::new(args.worker_processes > 0));
    let mut events = coordinator.subscribe();
    let listener = {
        let (watches, latencies, missed) = (
            Arc::clone(&watches),
            Arc::clone(&latencies),
            Arc::clone(&missed),
        );
        tokio::spawn(async move {
            loop {
                let event = match events.recv().await {
                    Ok(event) => event,
                    Err(RecvError::Lagged(count)) => {
                        eprintln!("warning: the benchmark's listener missed {count} events");
                        missed.store(true, Ordering::Relaxed);
                        continue;
                    }
                    Err(RecvError::Closed) => break,
                };
                let mut watches = watches.lock().expect("bench watch map");
                let Some(watch) = watches.get_mut(&event.session_id) else {
                    continue;
                };
                match event.kind.as_str() {
                    "step.committed" => {
                        let now = Instant::now();
                        latencies
                            .lock()
                            .expect("bench latencies")
                            .push(now - watch.last);
                        watch.last = now;
                    }
                    "run.finished" => {
                        if let Some(done) = watch.done.take() {
                            let _ = done.send(());
                        }
                    }
                    _ => {}
                }
            }
        })
    };

    // The store has the last word on whether a run ended once the bus may have dropped
    // events. One query for every run at once: a query per run, at a thousand runs in
    // flight, would load the store under test (and, on a server, queue behind the steps).
    let sweeper = {
        let (store, watches, missed) = (
            Arc::clone(coordinator.store()),
            Arc::clone(&watches),
            Arc::clone(&missed),
        );
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(STORE_CHECK).await;
                if !missed.load(Ordering::Relaxed) {
                    continue;
                }
                let runs = match store.list_runs().await {
                    Ok(runs) => runs,
                    Err(error) => {
                        eprintln!("warning: cannot ask the store which runs ended: {error}");
                        continue;
                    }
                };
                let mut watches = watches.lock().expect("bench watch map");
                for run in runs.iter().filter(|run| run.status.is_terminal()) {
                    if let Some(done) = watches
                        .get_mut(&run.session_id)
                        .and_then(|watch| watch.done.take())
                    {
                        let _ = done.send(());
                    }
                }
            }
        })
    };

    let cpu_before = cpu_time()?;
    let started = Instant::now();
    let permits = Arc::new(Semaphore::new(args.concurrency));
    let mut tasks = Vec::with_capacity(args.runs);
    for _ in 0..args.runs {
        let permit = Arc::clone(&permits).acquire_owned().await?;
        let (coordinator, watches, config) = (
            Arc::clone(&coordinator),
            Arc::clone(&watches),
            config.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let session = coordinator.create_session(SessionSpec::default()).await?.id;
            let (done, finished) = oneshot::channel();
            // Each run has its own session, so the watch is keyed by session and registered
            // before the submit: no event of the run can slip past it.
            watches.lock().expect("bench watch map").insert(
                session.clone(),
                Watch {
                    last: Instant::now(),
                    done: Some(done),
                },
            );
            let run = coordinator
                .submit(&session, "bench".into(), config, Multitask::Enqueue)
                .await?;
            if tokio::time::timeout(RUN_DEADLINE, finished).await.is_err() {
                bail!(
                    "run {} did not finish within {} s",
                    run.run_id,
                    RUN_DEADLINE.as_secs()
                );
            }
            anyhow::Ok(coordinator.store().load_state(&run.run_id).await?)
        }));
    }
    let mut steps = 0;
    let mut sessions = Vec::with_capacity(args.runs);
    for task in tasks {
        let state = task.await??;
        sessions.push(state.session_id.clone());
        if state.status != RunStatus::Completed || state.step_index != 2 * args.turns as u64 + 1 {
            bail!(
                "run {} ended {} after {} steps; expected completed after {}",
                state.run_id,
                state.status,
                state.step_index,
                2 * args.turns + 1
            );
        }
        steps += state.step_index;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu_ms_per_run = (cpu_time()? - cpu_before).as_secs_f64() * 1000.0 / args.runs as f64;
    let peak_rss = process_memory_bytes(std::process::id(), "VmHWM")?;
    if let Some(pool) = pool {
        pool.shutdown().await;
    }
    // Every run has ended: nothing is in flight that a kill could interrupt.
    for mut worker in workers {
        worker.start_kill()?;
        worker.wait().await?;
    }
    listener.abort();
    sweeper.abort();
    let webhook = match observer {
        Some(observer) => {
            observer
                .finish(coordinator.store().as_ref(), &sessions)
                .await?
        }
        None => Value::Null,
    };
    let bytes_after = database_bytes(&db)?;

    let mut latencies: Vec<f64> = std::mem::take(&mut *latencies.lock().expect("bench latencies"))
        .iter()
        .map(|d| d.as_secs_f64() * 1000.0)
        .collect();
    latencies.sort_by(f64::total_cmp);
    let steps_per_s = steps as f64 / elapsed;
    let runs_per_s = args.runs as f64 / elapsed;
    let (p50, p99) = (percentile(&latencies, 0.50), percentile(&latencies, 0.99));
    let over_commits = commits_per_s.map(|rate| steps_per_s / rate);
    // What the runs added: another database's or the schema's own bytes are not theirs.
    let bytes_per_step = (bytes_after as f64 - bytes_before as f64) / steps as f64;
    let report = json!({
        "db": if args.db.is_some() { db.as_str() } else { "sqlite (temporary file, synchronous=full)" },
        "runs": args.runs,
        "concurrency": args.concurrency,
        "turns": args.turns,
        "worker_processes": args.worker_processes,
        "steps": steps,
        "seconds": elapsed,
        "steps_per_s": steps_per_s,
        "runs_per_s": runs_per_s,
        "p50_ms": p50,
        "p99_ms": p99,
        "latency_samples": latencies.len(),
        "cpu_ms_per_run": cpu_ms_per_run,
        "peak_rss_mb": peak_rss as f64 / 1e6,
        "commits": commits_per_s.map(|_| args.commits),
        "commits_per_s": commits_per_s,
        "steps_per_s_over_commits_per_s": over_commits,
        "database_bytes_before": bytes_before,
        "database_bytes_after": bytes_after,
        "database_bytes_per_step": bytes_per_step,
        "webhook": webhook,
    });
    print_report(&report, args.json, || {
        let disk = match (commits_per_s, over_commits) {
            (Some(rate), Some(ratio)) => {
                format!("; the disk: {rate:.0} fsynced single-row commits/s, so {ratio:.2}x that")
            }
            _ => String::new(),
        };
        let webhook = match webhook["receiver"].as_str() {
            Some("answering") => format!(
                "; a webhook got {} events, {:.0}/s, p50 {:.0} ms and p99 {:.0} ms after their commit",
                webhook["deliveries"],
                webhook["deliveries_per_s"].as_f64().unwrap_or_default(),
                webhook["lag_p50_ms"].as_f64().unwrap_or_default(),
                webhook["lag_p99_ms"].as_f64().unwrap_or_default()
            ),
            Some(_) => format!(
                "; a webhook that never answers held {} attempts",
                webhook["attempts_in_flight"]
            ),
            None => String::new(),
        };
        format!(
            "{} runs x {} steps, {} at a time{}: {steps_per_s:.0} durable steps/s, {runs_per_s:.1} runs/s, step latency p50 {p50:.2} ms, p99 {p99:.2} ms{disk}; {cpu_ms_per_run:.2} ms of CPU per run and {:.1} MB peak resident memory in this process; the database grew {bytes_per_step:.0} bytes per step{webhook}",
            args.runs,
            2 * args.turns + 1,
            args.concurrency,
            match args.worker_processes {
                0 => String::new(),
                n => format!(", steps run by {n} worker processes"),
            },
            peak_rss as f64 / 1e6,
        )
    })
}

/// The CPU time (user and system, every thread) this process has used, from Linux's
/// `/proc/self/stat`, in its clock ticks of 10 ms.
fn cpu_time() -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").context("cannot read /proc/self/stat")?;
    // The fields after the parenthesised command name; utime and stime are the 14th and 15th
    // of the whole line, counted in USER_HZ (100 per second on Linux).
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| -> anyhow::Result<u64> {
        let field = fields
            .get(i)
            .context("/proc/self/stat is shorter than expected")?;
        field
            .parse()
            .with_context(|| format!("/proc/self/stat field {field:?} is not a tick count"))
    };
    Ok(Duration::from_millis((ticks(11)? + ticks(12)?) * 10))
}
