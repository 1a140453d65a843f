//! `ratchet bench recovery`: how long runs in flight take to go on after their process is
//! killed with SIGKILL.
//!
//! N runs are submitted from this process, which runs no steps; a `ratchet worker` child
//! with one worker per run takes them: each commits a model step, then starts a tool call
//! that sleeps `--step-ms`. Once every run is in that call, the child is killed with SIGKILL
//! and a fresh `ratchet worker` goes on with the runs, in one of two ways:
//!
//! - restart (the default): the fresh process starts after the kill, on the same machine;
//!   starting, it releases the dead process's leases, so no lease has to expire;
//! - takeover (`--takeover`): the fresh process was started before the kill, as another
//!   machine's would be, and claims the steps only once their leases expire (`--lease-ms`).
//!
//! From the kill, per run, by the times the store recorded (ms, this machine's clock): until
//! the interrupted step started again (the wait: leases expiring, or a process starting and
//! releasing them), from then until the step committed again (the work: the step done again,
//! its sleep included), and until the run completed. Each as p50 and max — the max is when
//! every run had got there.

use std::collections::HashSet;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::{StreamExt, TryStreamExt};
use ratchet_core::{Limits, Millis, RunConfigSnapshot, RunId, RunStatus};
use ratchet_engine::{Coordinator, Multitask, PoolConfig};
use ratchet_store::{Reads, SessionSpec};
use serde_json::json;

use crate::report::{
    percentile, print_report, scratch_database, scripted_model, scripted_run_config, start_process,
};
use ratchet::{Runtime, Schema, open_store};

/// How long each stage (getting every run into its slow step, then ending every run) may
/// take before the benchmark gives up.
const DEADLINE: Duration = Duration::from_secs(600);
/// How often the store is asked how far the runs have got.
const POLL: Duration = Duration::from_millis(20);
/// Sessions created and messages submitted at once.
const SUBMITTING_AT_ONCE: usize = 64;
const WORKER_READY: &str = "ratchet worker on database";

#[derive(Debug, clap::Args)]
pub struct RecoveryArgs {
    /// Database URL; a fresh temporary SQLite file when absent.
    #[arg(long)]
    pub db: Option<String>,
    /// Runs in flight when the worker is killed.
    #[arg(long)]
    pub runs: usize,
    /// How long the step in flight takes (a tool call that sleeps); it is done again
    /// after the kill, and must outlast getting every run into it.
    #[arg(long, value_name = "MS", default_value_t = 2000)]
    pub step_ms: u64,
    /// The workers' lease (default 15000, as `ratchet worker`'s).
    #[arg(long, value_name = "MS")]
    pub lease_ms: Option<u64>,
    /// Start the fresh worker before the kill, as another machine's would be: it takes
    /// the steps over when their leases expire. Without it, the fresh worker starts after
    /// the kill on this machine and frees the dead process's leases at once.
    #[arg(long)]
    pub takeover: bool,
    #[arg(long)]
    pub json: bool,
}

pub async fn recovery(args: RecoveryArgs) -> anyhow::Result<ExitCode> {
    if args.runs == 0 || args.step_ms == 0 {
        bail!("--runs and --step-ms must be at least 1");
    }
    let (scratch, db) = scratch_database(args.db.as_deref())?;
    let model = scripted_model(
        scratch.path(),
        json!([
            {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": args.step_ms}}]},
            {"text": "recovered"},
        ]),
    )?;
    let (toolbox, config) = scripted_run_config(model, Limits::default())?;
    // Passed explicitly, so that the lease reported is the one the workers hold.
    let lease_ms = args
        .lease_ms
        .unwrap_or(PoolConfig::default().lease.as_millis() as u64);
    let worker_args: Vec<String> = [
        "worker",
        "--db",
        &db,
        "--workers",
        &args.runs.to_string(),
        "--lease-ms",
        &lease_ms.to_string(),
    ]
    .map(str::to_owned)
    .into();
    let worker_args: Vec<&str> = worker_args.iter().map(String::as_str).collect();

    let runtime = Runtime::new(open_store(&db, Schema::Migrate)?, toolbox);
    let store = Arc::clone(runtime.coordinator.store());
    let submitted = Instant::now();
    let runs = submit(&runtime.coordinator, &config, args.runs).await?;
    let (mut doomed, _) = start_process("worker", &worker_args, WORKER_READY).await?;
    wait_until_in_flight(store.as_ref(), &runs, submitted, args.step_ms).await?;
    let standby = if args.takeover {
        Some(
            start_process("standby worker", &worker_args, WORKER_READY)
                .await?
                .0,
        )
    } else {
        None
    };

    let killed_at = now_ms();
    let killed = Instant::now();
    doomed.start_kill().context("cannot kill the worker")?;
    let status = doomed.wait().await?;
    if status.signal() != Some(9) {
        bail!("the worker ended before it was killed: {status}");
    }
    let (mut fresh, ready_ms) = match standby {
        Some(standby) => (standby, None),
        None => {
            let (fresh, _) = start_process("fresh worker", &worker_args, WORKER_READY).await?;
            (fresh, Some(killed.elapsed().as_secs_f64() * 1000.0))
        }
    };
    wait_until_ended(store.as_ref(), &runs).await?;
    // Every run has ended: nothing is in flight that a kill could interrupt.
    fresh.start_kill()?;
    fresh.wait().await?;

    let mut resumed = Vec::with_capacity(runs.len());
    let mut redone = Vec::with_capacity(runs.len());
    let mut next_step = Vec::with_capacity(runs.len());
    let mut completed = Vec::with_capacity(runs.len());
    for run in &runs {
        let times = recovery_times(store.as_ref(), run, killed_at).await?;
        resumed.push((times.restarted - killed_at) as f64);
        redone.push((times.committed - times.restarted) as f64);
        next_step.push((times.committed - killed_at) as f64);
        completed.push((times.finished - killed_at) as f64);
    }
    for figures in [&mut resumed, &mut redone, &mut next_step, &mut completed] {
        figures.sort_by(f64::total_cmp);
    }
    let mode = if args.takeover { "takeover" } else { "restart" };
    let report = json!({
        "db": if args.db.is_some() { db.as_str() } else { "sqlite (temporary file, synchronous=full)" },
        "runs": runs.len(),
        "step_ms": args.step_ms,
        "lease_ms": lease_ms,
        "mode": mode,
        "fresh_process_ready_ms": ready_ms,
        "resumed_p50_ms": percentile(&resumed, 0.5),
        "resumed_max_ms": percentile(&resumed, 1.0),
        "redo_p50_ms": percentile(&redone, 0.5),
        "redo_max_ms": percentile(&redone, 1.0),
        "next_step_p50_ms": percentile(&next_step, 0.5),
        "next_step_max_ms": percentile(&next_step, 1.0),
        "completed_p50_ms": percentile(&completed, 0.5),
        "completed_max_ms": percentile(&completed, 1.0),
    });
    print_report(&report, args.json, || {
        let how = match ready_ms {
            Some(ready) => format!("restart: a fresh worker was ready {ready:.0} ms after it"),
            None => format!("takeover: a standby worker waited for {lease_ms} ms leases"),
        };
        format!(
            "{} runs killed with SIGKILL in a {} ms step ({how}); from the kill: the steps started again after p50 {:.0} ms, max {:.0} ms; doing them again took p50 {:.0} ms, max {:.0} ms; every run had committed its next step after {:.0} ms (p50 {:.0} ms) and completed after {:.0} ms (p50 {:.0} ms)",
            runs.len(),
            args.step_ms,
            percentile(&resumed, 0.5),
            percentile(&resumed, 1.0),
            percentile(&redone, 0.5),
            percentile(&redone, 1.0),
            percentile(&next_step, 1.0),
            percentile(&next_step, 0.5),
            percentile(&completed, 1.0),
            percentile(&completed, 0.5),
        )
    })
}

/// Starts `count` runs, each in a session of its own.
async fn submit(
    coordinator: &Arc<Coordinator>,
    config: &RunConfigSnapshot,
    count: usize,
) -> anyhow::Result<Vec<RunId>> {
    futures::stream::iter(0..count)
        .map(|_| async {
            let session = coordinator.create_session(SessionSpec::default()).await?.id;
            let started = coordinator
                .submit(&session, "bench".into(), config.clone(), Multitask::Enqueue)
                .await?;
            anyhow::Ok(started.run_id)
        })
        .buffer_unordered(SUBMITTING_AT_ONCE)
        .try_collect()
        .await
}

/// Waits until every run has started its slow tool call (its `tool.call` event is stored).
/// A run that got past the call first means the call is too short for all to be caught in it.
async fn wait_until_in_flight(
    store: &dyn Reads,
    runs: &[RunId],
    submitted: Instant,
    step_ms: u64,
) -> anyhow::Result<()> {
    let mut outside: HashSet<&RunId> = runs.iter().collect();
    let deadline = Instant::now() + DEADLINE;
    while !outside.is_empty() {
        for summary in store.list_runs().await? {
            if !outside.contains(&summary.run_id) {
                continue;
            }
            if summary.step_index > 1 || summary.status.is_terminal() {
                bail!(
                    "run {} finished its {step_ms} ms step before all {} runs had started theirs \
                     ({} ms after submitting): give --step-ms more time",
                    summary.run_id,
                    runs.len(),
                    submitted.elapsed().as_millis()
                );
            }
            // The commit of the model step leased the slow tools step to the same worker,
            // which runs it now (its `tool.call` is stored only with the step's commit).
            if summary.step_index == 1 {
                outside.remove(&summary.run_id);
            }
        }
        if Instant::now() > deadline {
            bail!(
                "only {} of {} runs started their slow step within {} s",
                runs.len() - outside.len(),
                runs.len(),
                DEADLINE.as_secs()
            );
        }
        tokio::time::sleep(POLL).await;
    }
    Ok(())
}

async fn wait_until_ended(store: &dyn Reads, runs: &[RunId]) -> anyhow::Result<()> {
    let wanted: HashSet<&RunId> = runs.iter().collect();
    let deadline = Instant::now() + DEADLINE;
    loop {
        let ended = store
            .list_runs()
            .await?
            .iter()
            .filter(|r| wanted.contains(&r.run_id) && r.status.is_terminal())
            .count();
        if ended == runs.len() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "only {ended} of {} runs ended within {} s of the kill",
                runs.len(),
                DEADLINE.as_secs()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// When a run's interrupted step (step 2) started again and committed, and when the run
/// finished, as the store recorded them.
struct Times {
    restarted: Millis,
    committed: Millis,
    finished: Millis,
}

async fn recovery_times(
    store: &dyn Reads,
    run: &RunId,
    killed_at: Millis,
) -> anyhow::Result<Times> {
    let state = store.load_state(run).await?;
    if state.status != RunStatus::Completed || state.step_index != 3 {
        bail!(
            "run {run} ended {} after {} steps; expected completed after 3",
            state.status,
            state.step_index
        );
    }
    let finished = state
        .finished_at
        .with_context(|| format!("run {run} completed without a finish time"))?;
    // A step's record is its committed attempt's: it started when that attempt did.
    let restarted = store
        .steps(run)
        .await?
        .iter()
        .find(|step| step.index == 2)
        .with_context(|| format!("run {run} has no record of its step 2"))?
        .started_at;
    if restarted < killed_at {
        bail!(
            "run {run}'s step 2 committed an attempt started {} ms before the kill: it was not \
             in flight",
            killed_at - restarted
        );
    }
    let committed = store
        .run_events_after(run, 0, 1000)
        .await?
        .iter()
        .find(|event| event.kind == "step.committed" && event.payload["step_index"] == 2)
        .with_context(|| format!("run {run} has no step.committed event for its step 2"))?
        .created_at;
    Ok(Times {
        restarted,
        committed,
        finished,
    })
}

/// Milliseconds since the epoch, as the store stamps its records.
fn now_ms() -> Millis {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as Millis)
}
