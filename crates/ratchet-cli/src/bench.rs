//! `ratchet bench steps`: durable step throughput and latency on a real store.
//!
//! Each run is K round-trips (a model call answering one `add` call, then that tool batch)
//! and a final answer: 2K+1 durable steps. Step latency is measured as a client sees it:
//! the time between consecutive `step.committed` events of a run (the first from submit).

use std::collections::HashMap;
use std::io::Write;
use std::process::ExitCode;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ratchet_core::{Limits, MemoryScope, RunConfigSnapshot, RunStatus, SessionId};
use ratchet_engine::{Multitask, PoolConfig};
use ratchet_store::SessionSpec;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::{Semaphore, broadcast::error::RecvError, oneshot};

use crate::runtime::{Runtime, Schema, Toolbox, announces_changes, open_store};

pub struct StepsArgs {
    pub db: Option<String>,
    pub runs: usize,
    pub concurrency: usize,
    pub turns: usize,
    pub worker_processes: usize,
    pub json: bool,
}

struct Watch {
    last: Instant,
    done: Option<oneshot::Sender<()>>,
}

pub async fn steps(args: StepsArgs) -> anyhow::Result<ExitCode> {
    if args.runs == 0 || args.concurrency == 0 {
        bail!("--runs and --concurrency must be at least 1");
    }
    let scratch = tempfile::tempdir().context("cannot create a scratch directory")?;
    let db = match &args.db {
        Some(db) => db.clone(),
        None => format!("sqlite://{}", scratch.path().join("bench.db").display()),
    };
    if args.worker_processes > 0 && !announces_changes(&db)? {
        bail!(
            "--worker-processes needs a database that tells other processes of its changes \
             (--db postgres://…): over SQLite this process would not hear of their steps"
        );
    }
    let script_path = scratch.path().join("script.json");
    let mut replies: Vec<_> = (0..args.turns)
        .map(|i| json!({"tool_calls": [{"name": "add", "arguments": {"a": i, "b": 1}}]}))
        .collect();
    replies.push(json!({"text": "done"}));
    std::fs::write(&script_path, json!({"replies": replies}).to_string())?;
    let toolbox = Toolbox::new();
    let tools = toolbox.tools.specs();
    let model = format!("scripted:{}", script_path.display());
    toolbox.models.resolve(&model)?;
    let config = RunConfigSnapshot {
        model,
        model_settings: None,
        workspace: None,
        system_prompt: String::new(),
        tools,
        // Room for every round-trip without the budget forcing a concluding call.
        limits: Limits {
            max_steps: 2 * args.turns as u64 + 3,
            ..Limits::default()
        },
        memory_scope: MemoryScope::Session,
    };
    let runtime = Runtime::new(open_store(&db, Schema::Migrate)?, toolbox);
    let coordinator = Arc::clone(&runtime.coordinator);
    let pool = (args.worker_processes == 0).then(|| {
        runtime.start_workers(PoolConfig {
            workers: args.concurrency,
            ..PoolConfig::default()
        })
    });
    let mut workers = Vec::with_capacity(args.worker_processes);
    for _ in 0..args.worker_processes {
        workers.push(start_worker_process(&db, args.concurrency).await?);
    }

    let watches: Arc<std::sync::Mutex<HashMap<SessionId, Watch>>> = Arc::default();
    let latencies: Arc<std::sync::Mutex<Vec<Duration>>> = Arc::default();
    let mut events = coordinator.subscribe();
    let listener = {
        let (watches, latencies) = (Arc::clone(&watches), Arc::clone(&latencies));
        tokio::spawn(async move {
            loop {
                let event = match events.recv().await {
                    Ok(event) => event,
                    Err(RecvError::Lagged(missed)) => {
                        eprintln!("warning: the benchmark's listener missed {missed} events");
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
            // The event bus is best-effort (a relay of another process's events can fall
            // behind and drop some): the store has the last word on whether the run ended.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
            tokio::pin!(finished);
            loop {
                tokio::select! {
                    _ = &mut finished => break,
                    () = tokio::time::sleep(Duration::from_millis(500)) => {
                        let state = coordinator.store().load_state(&run.run_id).await?;
                        if state.status.is_terminal() {
                            break;
                        }
                    }
                }
                if tokio::time::Instant::now() > deadline {
                    bail!("run {} did not finish within 120 s", run.run_id);
                }
            }
            anyhow::Ok(coordinator.store().load_state(&run.run_id).await?)
        }));
    }
    let mut steps = 0;
    for task in tasks {
        let state = task.await??;
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
    let elapsed = started.elapsed();
    if let Some(pool) = pool {
        pool.shutdown().await;
    }
    // Every run has ended: nothing is in flight that a kill could interrupt.
    for mut worker in workers {
        worker.start_kill()?;
        worker.wait().await?;
    }
    listener.abort();

    let mut latencies = std::mem::take(&mut *latencies.lock().expect("bench latencies"));
    latencies.sort();
    let percentile = |p: f64| {
        let index = ((latencies.len() as f64 - 1.0) * p).round() as usize;
        latencies
            .get(index)
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    let report = json!({
        "db": if args.db.is_some() { db.as_str() } else { "sqlite (temporary file, synchronous=full)" },
        "runs": args.runs,
        "concurrency": args.concurrency,
        "turns": args.turns,
        "worker_processes": args.worker_processes,
        "steps": steps,
        "seconds": elapsed.as_secs_f64(),
        "steps_per_s": steps as f64 / elapsed.as_secs_f64(),
        "runs_per_s": args.runs as f64 / elapsed.as_secs_f64(),
        "p50_ms": percentile(0.50),
        "p99_ms": percentile(0.99),
        "latency_samples": latencies.len(),
    });
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{report}")?;
    } else {
        writeln!(
            out,
            "{} runs x {} steps, {} at a time{}: {:.0} durable steps/s, {:.1} runs/s, step latency p50 {:.2} ms, p99 {:.2} ms",
            args.runs,
            2 * args.turns + 1,
            args.concurrency,
            match args.worker_processes {
                0 => String::new(),
                n => format!(", steps run by {n} worker processes"),
            },
            report["steps_per_s"].as_f64().unwrap_or_default(),
            report["runs_per_s"].as_f64().unwrap_or_default(),
            report["p50_ms"].as_f64().unwrap_or_default(),
            report["p99_ms"].as_f64().unwrap_or_default(),
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Starts `ratchet worker` on `db` and waits until it says it runs: the benchmark's clock
/// must not include a process starting. Its later output is read and dropped.
async fn start_worker_process(db: &str, workers: usize) -> anyhow::Result<tokio::process::Child> {
    let mut child = tokio::process::Command::new(std::env::current_exe()?)
        .args(["worker", "--db", db, "--workers", &workers.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("cannot start a worker process")?;
    let stderr = child.stderr.take().context("a worker's stderr")?;
    let mut lines = BufReader::new(stderr).lines();
    let ready = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await? {
            if line.starts_with("ratchet worker on database") {
                return anyhow::Ok(true);
            }
            eprintln!("worker: {line}");
        }
        anyhow::Ok(false)
    })
    .await;
    match ready {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => bail!(
            "a worker process exited before it started: {}",
            child.wait().await?
        ),
        Ok(Err(error)) => return Err(error.context("cannot read a worker's output")),
        Err(_) => bail!("a worker process did not start within 30 s"),
    }
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(child)
}
