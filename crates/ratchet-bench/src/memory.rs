//! `ratchet bench memory`: the resident memory a server spends per idle session and per run
//! waiting for a human.
//!
//! A `ratchet serve` child on a fresh temporary SQLite database (or `--db`), with a scripted
//! model whose first reply calls `add`, which its configuration gates behind an approval.
//! Its resident set (`VmRSS` in `/proc/PID/status`, so Linux only) is read three times:
//! after one warm-up session has been through everything below, so that what a process
//! allocates once is not counted per session; after N sessions each have one completed run
//! (a message, its approval answered through the API, the tool's result and the answer:
//! history the session keeps); and after each of those sessions has a second run waiting for
//! its approval. Reported: the two growths divided by N, and the database's size at each
//! stage — on SQLite the server's page cache (up to 64 MiB on the writer's connection) holds
//! the pages it wrote, so part of the growth is cached database rather than sessions.
//! Resident memory moves in pages and the allocator keeps some of what it frees, so only
//! large N say much.

use std::process::ExitCode;

use anyhow::{Context, bail};
use futures::{StreamExt, TryStreamExt};
use ratchet_core::{ApprovalAnswer, CallDecision, HumanRequest, RunStatus, Verdict};
use serde_json::json;

use crate::report::{print_report, scratch_database, scripted_model, start_process};
use ratchet::database_bytes;
use ratchet_client::{self as client, Api, RunView};

/// Sessions driven at once.
const AT_ONCE: usize = 16;
const SERVER_READY: &str = "ratchet listening on http://";

#[derive(Debug, clap::Args)]
pub struct MemoryArgs {
    /// Database URL; a fresh temporary SQLite file when absent.
    #[arg(long)]
    pub db: Option<String>,
    /// Sessions created (each with one completed run, then one waiting run).
    #[arg(long)]
    pub sessions: usize,
    #[arg(long)]
    pub json: bool,
}

/// The server's resident memory and the database's size at one stage, in bytes.
struct Stage {
    resident: u64,
    database: u64,
}

impl Stage {
    fn now(pid: u32, db: &str) -> anyhow::Result<Stage> {
        Ok(Stage {
            resident: crate::report::process_memory_bytes(pid, "VmRSS")?,
            database: database_bytes(db)?,
        })
    }
}

struct Stages {
    baseline: Stage,
    idle: Stage,
    waiting: Stage,
    pending_approvals: usize,
}

pub async fn memory(args: MemoryArgs) -> anyhow::Result<ExitCode> {
    if args.sessions == 0 {
        bail!("--sessions must be at least 1");
    }
    let (scratch, db) = scratch_database(args.db.as_deref())?;
    let model = scripted_model(
        scratch.path(),
        json!([
            {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]},
            {"text": "2 + 3 = 5."},
        ]),
    )?;
    let config = scratch.path().join("ratchet.toml");
    std::fs::write(&config, "[tools.add]\napproval = \"always\"\n")?;
    let workspace = scratch.path().display().to_string();
    let config = config.display().to_string();
    let (mut server, ready) = start_process(
        "server",
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--db",
            &db,
            "--model",
            &model,
            "--workspace",
            &workspace,
            "--config",
            &config,
        ],
        SERVER_READY,
    )
    .await?;
    let address = ready
        .strip_prefix(SERVER_READY)
        .and_then(|rest| rest.split(' ').next())
        .with_context(|| format!("no address in the server's first line {ready:?}"))?;
    let pid = server.id().context("the server has no process id")?;
    let api = Api::new(address, None, AT_ONCE)?;
    let measured = measure(&api, pid, &db, args.sessions).await;
    server.start_kill()?;
    server.wait().await?;
    let stages = measured?;

    let sessions = args.sessions as f64;
    let growth = |from: &Stage, to: &Stage| (to.resident as f64 - from.resident as f64) / sessions;
    let per_session = growth(&stages.baseline, &stages.idle);
    let per_waiting_run = growth(&stages.idle, &stages.waiting);
    let report = json!({
        "db": if args.db.is_some() { db.as_str() } else { "sqlite (temporary file, synchronous=full)" },
        "sessions": args.sessions,
        "pending_approvals": stages.pending_approvals,
        "baseline_rss_bytes": stages.baseline.resident,
        "idle_rss_bytes": stages.idle.resident,
        "waiting_rss_bytes": stages.waiting.resident,
        "bytes_per_idle_session": per_session,
        "bytes_per_waiting_run": per_waiting_run,
        "baseline_database_bytes": stages.baseline.database,
        "idle_database_bytes": stages.idle.database,
        "waiting_database_bytes": stages.waiting.database,
    });
    let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
    print_report(&report, args.json, || {
        format!(
            "{} idle sessions with one completed run each: {per_session:.0} bytes each; {} runs waiting for an approval: {per_waiting_run:.0} bytes each (server resident memory {:.1} MiB warmed up, {:.1} MiB with the sessions, {:.1} MiB with the waiting runs; database {:.1}, {:.1} and {:.1} MiB)",
            args.sessions,
            args.sessions,
            mib(stages.baseline.resident),
            mib(stages.idle.resident),
            mib(stages.waiting.resident),
            mib(stages.baseline.database),
            mib(stages.idle.database),
            mib(stages.waiting.database),
        )
    })
}

async fn measure(api: &Api, pid: u32, db: &str, sessions: usize) -> anyhow::Result<Stages> {
    let warm_up = api.create_session(None).await?.id;
    complete_a_run(api, &warm_up).await?;
    leave_a_run_waiting(api, &warm_up).await?;
    let baseline = Stage::now(pid, db)?;

    let created: Vec<String> = futures::stream::iter(0..sessions)
        .map(|_| async {
            let session = api.create_session(None).await?.id;
            complete_a_run(api, &session).await?;
            anyhow::Ok(session)
        })
        .buffer_unordered(AT_ONCE)
        .try_collect()
        .await?;
    let idle = Stage::now(pid, db)?;

    futures::stream::iter(&created)
        .map(|session| leave_a_run_waiting(api, session))
        .buffer_unordered(AT_ONCE)
        .try_collect::<Vec<()>>()
        .await?;
    let pending_approvals = api.approvals(Some("pending")).await?.len();
    if pending_approvals != sessions + 1 {
        bail!(
            "expected {} pending approvals (one per session and the warm-up's), found {pending_approvals}",
            sessions + 1
        );
    }
    let waiting = Stage::now(pid, db)?;
    Ok(Stages {
        baseline,
        idle,
        waiting,
        pending_approvals,
    })
}

/// Sends a message, approves the call it waits on, and follows the run to its completion.
async fn complete_a_run(api: &Api, session: &str) -> anyhow::Result<()> {
    let (run, seen) = run_until_approval(api, session).await?;
    let (id, calls) = (run.pending_human.as_ref())
        .and_then(HumanRequest::approval)
        .with_context(|| format!("run {} waits, but not for an approval", run.id))?;
    let answer = ApprovalAnswer::Decisions(
        calls
            .iter()
            .map(|call| CallDecision {
                call_id: call.call_id.clone(),
                decision: Verdict::Approve,
                note: None,
            })
            .collect(),
    );
    api.answer_approval(id, &answer).await?;
    let run = client::follow_run(api, &run.id, seen, |_| {}).await?;
    if run.status != RunStatus::Completed {
        bail!(
            "run {} ended {} after its approval; expected completed",
            run.id,
            run.status
        );
    }
    Ok(())
}

async fn leave_a_run_waiting(api: &Api, session: &str) -> anyhow::Result<()> {
    run_until_approval(api, session).await.map(|_| ())
}

/// Sends a message and follows its run until it waits for an approval; returns the run and
/// the last event seen.
async fn run_until_approval(api: &Api, session: &str) -> anyhow::Result<(RunView, i64)> {
    let accepted = api.send_message(session, "add 2 and 3").await?;
    let mut seen = 0;
    let run = client::follow_run(api, &accepted.run_id, 0, |event| seen = event.seq).await?;
    if run.status != RunStatus::WaitingHuman {
        bail!(
            "run {} is {}; expected it to wait for an approval of its `add` call",
            run.id,
            run.status
        );
    }
    Ok((run, seen))
}
