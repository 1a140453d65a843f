//! `ratchet run` and `ratchet resume`: drive runs in this process until they end or wait.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::bail;
use ratchet_core::{AgentState, HumanRequest, RunId, RunStatus, SessionId};
use ratchet_engine::{Multitask, PoolConfig};
use ratchet_store::{Reads, SessionSpec, StoredEvent};
use serde::Serialize;
use tokio::sync::broadcast::error::RecvError;

use crate::approve;
use ratchet::{Runtime, Schema, ToolOverrides, Toolbox, open_existing_store, open_store};
use ratchet_client::{Api, EventView};

/// How often a driver re-reads the store: events of its run may never reach its bus (another
/// process may execute a step) and a wake-up may be missed.
const RECHECK: Duration = Duration::from_millis(200);

pub struct RunArgs {
    pub db: String,
    pub model: String,
    pub workspace: Option<PathBuf>,
    pub limits: ratchet_core::Limits,
    pub overrides: ToolOverrides,
    pub profiles: BTreeMap<String, ratchet_llm::profiles::Profile>,
    pub mcp: ratchet_mcp::Config,
    pub memory_scope: ratchet_core::MemoryScope,
    /// `--no-migrate`: refuse a database whose schema is behind instead of migrating it.
    pub schema: Schema,
    pub json: bool,
    pub message: String,
    /// The catalog agent that answers, instead of the flags' model.
    pub catalog: Option<Pick>,
    pub quota: ratchet_store::RunQuota,
    /// `[delegation] max_tree_tokens` and `max_tree_cost_usd`.
    pub tree_budget: ratchet_core::TreeBudget,
    pub permits: ratchet_engine::PermitLimits,
    /// `[limits] max_snippet_bytes`.
    pub max_snippet_bytes: usize,
    /// The configuration's worker settings (`lease_ms`, `cancel_grace_ms`, …).
    pub pool: PoolConfig,
}

/// A catalog and the agent of it that answers.
pub struct Pick {
    pub dir: PathBuf,
    pub agent: String,
    pub tree: ratchet::agents::TreeLimits,
}

/// What `run` and `resume` print for each run.
#[derive(Debug, Serialize)]
pub struct RunReport {
    pub session_id: String,
    pub run_id: String,
    pub status: RunStatus,
    pub stop_reason: Option<ratchet_core::StopReason>,
    pub steps: u64,
    pub final_answer: Option<String>,
}

impl RunReport {
    pub fn of(state: &AgentState) -> RunReport {
        RunReport {
            session_id: state.session_id.to_string(),
            run_id: state.run_id.to_string(),
            status: state.status,
            stop_reason: state.stop_reason,
            steps: state.step_index,
            // As the API says it: only a completed run has an answer.
            final_answer: (state.final_answer.clone())
                .filter(|_| state.status == RunStatus::Completed),
        }
    }

    pub fn exit_code(&self) -> ExitCode {
        match self.status {
            RunStatus::Completed => ExitCode::SUCCESS,
            status if status.is_waiting() => ExitCode::from(2),
            _ => ExitCode::FAILURE,
        }
    }
}

fn check_message(message: &str) -> anyhow::Result<()> {
    if message.trim().is_empty() {
        bail!("MESSAGE is empty; expected the text to send to the agent");
    }
    Ok(())
}

pub async fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    // Validate before opening the store, so that bad input never creates a database.
    check_message(&args.message)?;
    let toolbox = Toolbox::with_mcp(&args.mcp, args.max_snippet_bytes)
        .await?
        .with_profiles(args.profiles.clone())?;
    let mut config = toolbox.run_template(
        &args.model,
        args.workspace.as_deref(),
        args.limits,
        &args.overrides,
        args.memory_scope,
    )?;
    config.delegation.tree_budget = args.tree_budget;
    if let Some(pick) = &args.catalog {
        let catalog = ratchet::agents::load(&pick.dir, &toolbox)?;
        let profiles = ratchet::agents::profiles(&catalog, &toolbox, &config, pick.tree)?;
        let Some(profile) = profiles.into_iter().find(|p| p.id == pick.agent) else {
            let known: Vec<&str> = catalog.agents().map(|a| a.id.as_str()).collect();
            bail!(
                "no agent {:?} in {}; its agents are: {}",
                pick.agent,
                pick.dir.display(),
                known.join(", ")
            );
        };
        config = profile.config;
    }
    let runtime = Runtime::gated(
        open_store(&args.db, args.schema)?,
        toolbox,
        args.quota,
        args.permits,
    );
    let coordinator = &runtime.coordinator;
    let mut events = coordinator.subscribe();
    let session = coordinator.create_session(SessionSpec::default()).await?.id;
    let mut feed = SessionFeed {
        session: session.clone(),
        seen: 0,
    };
    let started = coordinator
        .submit(&session, args.message.clone(), config, Multitask::Enqueue)
        .await?;
    let run_id = started.run_id;
    // This process drives its own run only; other runs in the database are `resume`'s job.
    let pool = runtime.start_workers(PoolConfig {
        only_run: Some(run_id.clone()),
        ..args.pool.clone()
    });
    let mut stderr = std::io::stderr();
    // Read only once the run asks: stdin stays untouched by runs that never do.
    let mut answers = None;
    let mut recheck = tokio::time::interval(RECHECK);
    let state = loop {
        let received = tokio::select! {
            event = events.recv() => Some(event),
            _ = recheck.tick() => None,
        };
        if let Some(Err(RecvError::Closed)) = received {
            bail!("the event bus closed while run {run_id} was active");
        }
        // Without a live event in turn, the store decides: nothing may have been announced.
        let mut look = !matches!(received, Some(Ok(_)));
        for event in feed.next(coordinator.store().as_ref(), received).await? {
            if event.run_id.as_ref() == Some(&run_id) {
                show_progress(&mut stderr, &event.kind, &event.payload);
                look |= event.kind == "run.status" || event.kind == "run.finished";
            }
        }
        if !look {
            continue;
        }
        let state = coordinator.store().load_state(&run_id).await?;
        if state.status.is_terminal() {
            break state;
        }
        if state.status == RunStatus::Paused {
            eprintln!(
                "run {run_id} was paused; `ratchet runs resume {run_id} --db {}` then `ratchet resume` carry it on",
                args.db
            );
            break state;
        }
        // The run, or a run its delegations started, may wait for a person.
        if let Some(waiting) = waiting_for_human(coordinator.store().as_ref(), &state).await? {
            let Some((id, calls)) =
                (waiting.pending_human.as_ref()).and_then(HumanRequest::approval)
            else {
                break state;
            };
            let lines = answers.get_or_insert_with(approve::stdin_lines);
            // The run may end while the prompt waits (past its deadline, or cancelled from
            // elsewhere): then the question is moot and the loop reports how it ended.
            let asked = tokio::select! {
                asked = approve::ask(id, calls, lines) => asked?,
                ended = until_ended(coordinator.store().as_ref(), &run_id) => {
                    ended?;
                    eprintln!();
                    continue;
                }
            };
            match asked {
                Some(answer) => {
                    coordinator
                        .answer_approval(id, answer, COMMAND_LINE)
                        .await?;
                }
                None => {
                    eprintln!(
                        "answer with `ratchet approvals decide {id} --db {}`, then `ratchet resume`",
                        args.db
                    );
                    break state;
                }
            }
        }
    };
    pool.shutdown().await;
    runtime.close_tools().await;
    tell_of_background_work(coordinator.store().as_ref(), &state, &args.db).await?;
    let report = RunReport::of(&state);
    print_report(&report, args.json, true)?;
    Ok(report.exit_code())
}

/// Returns once the run has ended, looking every `RECHECK`.
async fn until_ended(store: &dyn Reads, run_id: &RunId) -> anyhow::Result<()> {
    loop {
        tokio::time::sleep(RECHECK).await;
        if store.load_state(run_id).await?.status.is_terminal() {
            return Ok(());
        }
    }
}

/// `ratchet run` drives the run it started and the runs it waits for; background work it
/// started, and the continuation turn that reports it, go on without it. Says so, and how to
/// finish them.
async fn tell_of_background_work(
    store: &dyn Reads,
    state: &AgentState,
    db: &str,
) -> anyhow::Result<()> {
    let tree = store.run_tree(&state.run_id).await?;
    let running = tree
        .iter()
        .filter(|n| n.background && !n.status.is_terminal())
        .count();
    let session = store.get_session(&state.session_id).await?;
    // Reports waiting for a later attempt count too: every pending one, whenever it is due.
    let pending = store
        .pending_input(&state.session_id, ratchet_core::Millis::MAX)
        .await?;
    let continuing = session
        .active_run_id
        .filter(|r| r != &state.run_id)
        .is_some();
    if running > 0 || continuing || pending.inbox_events > 0 {
        eprintln!(
            "background work goes on in session {}: {running} background run(s), {} report(s) waiting{}; \
             `ratchet resume --db {db}` (or a `ratchet serve` on this database) finishes it",
            state.session_id,
            pending.inbox_events,
            if continuing {
                ", a continuation turn started"
            } else {
                ""
            }
        );
    }
    Ok(())
}

/// The run waiting for a person: `state`'s own run, or — while it waits for its children —
/// the first run below it that does.
async fn waiting_for_human(
    store: &dyn Reads,
    state: &AgentState,
) -> anyhow::Result<Option<AgentState>> {
    match state.status {
        RunStatus::WaitingHuman => Ok(Some(state.clone())),
        RunStatus::WaitingChildren => {
            let tree = store.run_tree(&state.run_id).await?;
            match tree.iter().find(|n| n.status == RunStatus::WaitingHuman) {
                Some(node) => Ok(Some(store.load_state(&node.run_id).await?)),
                None => Ok(None),
            }
        }
        _ => Ok(None),
    }
}

/// One session's events in `seq` order, each exactly once, whichever process executed the
/// steps: a live event in turn is taken as it is; one past a gap (events of a session can be
/// published out of order, or by another process without reaching this bus), a lagged
/// subscription or a quiet spell sends the feed to the store for everything after the last
/// event it took.
struct SessionFeed {
    session: SessionId,
    /// Every event of the session up to this `seq` has been taken.
    seen: i64,
}

impl SessionFeed {
    /// The events to take after `received` from the bus (`None`: nothing came for a while).
    async fn next(
        &mut self,
        store: &dyn Reads,
        received: Option<Result<StoredEvent, RecvError>>,
    ) -> anyhow::Result<Vec<StoredEvent>> {
        match received {
            Some(Ok(event)) if event.session_id != self.session || event.seq <= self.seen => {
                Ok(Vec::new())
            }
            Some(Ok(event)) if event.seq == self.seen + 1 => {
                self.seen = event.seq;
                Ok(vec![event])
            }
            _ => self.catch_up(store).await,
        }
    }

    async fn catch_up(&mut self, store: &dyn Reads) -> anyhow::Result<Vec<StoredEvent>> {
        const PAGE: u32 = 500;
        let mut events = Vec::new();
        loop {
            let page = store.events_after(&self.session, self.seen, PAGE).await?;
            let full = page.len() as u32 == PAGE;
            if let Some(last) = page.last() {
                self.seen = last.seq;
            }
            events.extend(page);
            if !full {
                return Ok(events);
            }
        }
    }
}

pub struct RemoteRunArgs {
    pub server: String,
    pub agent: Option<String>,
    pub token: Option<String>,
    pub json: bool,
    pub message: String,
}

/// `ratchet run --server`: the same run and the same output as in-process, through the
/// HTTP API. The run's events are followed (and the stream resumed with `Last-Event-ID` if
/// it drops) until the run ends or waits; the report is the server's view of the run.
pub async fn run_remote(args: RemoteRunArgs) -> anyhow::Result<ExitCode> {
    check_message(&args.message)?;
    let api = Api::new(&args.server, args.token, 4)?;
    let session = api.create_session(args.agent.as_deref()).await?;
    let accepted = api.send_message(&session.id, &args.message).await?;
    let mut stderr = std::io::stderr();
    let mut lines = approve::stdin_lines();
    let run = approve::follow_answering(
        &api,
        &accepted.run_id,
        &mut lines,
        |event| show_tree_progress(&mut stderr, event),
        |_| {},
    )
    .await?;
    let report = RunReport {
        session_id: run.session_id,
        run_id: run.id,
        status: run.status,
        stop_reason: run.stop_reason,
        steps: run.step_index,
        final_answer: run.final_answer,
    };
    print_report(&report, args.json, true)?;
    Ok(report.exit_code())
}

/// `mcp`: the servers whose tools the runs were started with (`--config`), started again;
/// `pool`: the configuration's worker settings (its `cancel_grace_ms` among them).
pub async fn resume(
    db: &str,
    json: bool,
    mcp: &ratchet_mcp::Config,
    max_snippet_bytes: usize,
    pool: PoolConfig,
) -> anyhow::Result<ExitCode> {
    let store = open_existing_store(db)?;
    let runtime = Runtime::new(store, Toolbox::with_mcp(mcp, max_snippet_bytes).await?);
    let store = runtime.coordinator.store();
    let active: Vec<RunId> = store
        .list_runs()
        .await?
        .into_iter()
        .filter(|r| {
            matches!(
                r.status,
                RunStatus::Running
                    | RunStatus::Cancelling
                    | RunStatus::Queued
                    | RunStatus::WaitingChildren
                    | RunStatus::WaitingTimer
            )
        })
        .map(|r| r.run_id)
        .collect();
    let mut events = runtime.coordinator.subscribe();
    let pool = runtime.recover_and_start(pool).await?;
    let mut stderr = std::io::stderr();
    loop {
        if store.runs_with_jobs().await?.is_empty() {
            break;
        }
        tokio::select! {
            event = events.recv() => {
                if let Ok(event) = event {
                    show_progress(&mut stderr, &event.kind, &event.payload);
                }
            }
            () = tokio::time::sleep(RECHECK) => {}
        }
    }
    pool.shutdown().await;
    runtime.close_tools().await;
    let mut code = ExitCode::SUCCESS;
    for run_id in active {
        let report = RunReport::of(&store.load_state(&run_id).await?);
        if report.status != RunStatus::Completed {
            code = report.exit_code();
        }
        print_report(&report, json, false)?;
    }
    Ok(code)
}

/// What a tree stream's event shows: a root event as `show_progress` shows it; of a run
/// below, only what it does (its tool calls and results, the runs it starts, a wait for a
/// human), indented by its depth. A child's text is not shown: it is its parent's tool result.
/// Who answers an approval from this process's own prompt or `approvals decide --db`.
pub(crate) const COMMAND_LINE: &str = "the command line";

pub(crate) fn show_tree_progress(out: &mut impl Write, event: &EventView) {
    if event.depth == 0 {
        return show_progress(out, &event.kind, &event.payload);
    }
    if !CHILD_SHOWN.contains(&event.kind.as_str()) {
        return;
    }
    let mut lines = Vec::new();
    show_progress(&mut lines, &event.kind, &event.payload);
    let indent = "  ".repeat(event.depth as usize);
    for line in String::from_utf8_lossy(&lines).lines() {
        let _ = writeln!(out, "{indent}{line}");
    }
    let _ = out.flush();
}

/// The events of a run below the followed one that a terminal shows.
pub(crate) const CHILD_SHOWN: [&str; 6] = [
    "tool.call",
    "tool.result",
    "tool.outcome_unknown",
    "reconciliation.required",
    "subagent.started",
    "subagent.finished",
];

pub(crate) fn show_progress(out: &mut impl Write, kind: &str, payload: &serde_json::Value) {
    let _ = match kind {
        "assistant.delta" => write!(out, "{}", payload["text"].as_str().unwrap_or_default()),
        "assistant.message" => writeln!(out),
        "tool.call" => writeln!(
            out,
            "  [{}] {} {}",
            payload["call_id"].as_str().unwrap_or_default(),
            payload["tool"].as_str().unwrap_or_default(),
            payload["arguments"]
        ),
        "tool.result" => writeln!(
            out,
            "  [{}] -> {}",
            payload["call_id"].as_str().unwrap_or_default(),
            payload["content"].as_str().unwrap_or_default()
        ),
        "model.error" => writeln!(
            out,
            "  model call failed{}: {}{}",
            payload["attempt"]
                .as_u64()
                .map(|n| format!(" (attempt {n})"))
                .unwrap_or_default(),
            payload["message"].as_str().unwrap_or_default(),
            if payload["final"] == true {
                "; giving up"
            } else {
                "; retrying"
            }
        ),
        "timer.set" => writeln!(
            out,
            "  [{}] waiting {} ms, until {}",
            payload["call_id"].as_str().unwrap_or_default(),
            payload["wait_ms"],
            payload["due_at"]
                .as_i64()
                .map(ratchet_core::timer::format_rfc3339)
                .unwrap_or_default()
        ),
        "timer.woke" => writeln!(
            out,
            "  [{}] woke ({}) after {} ms",
            payload["call_id"].as_str().unwrap_or_default(),
            payload["woke"].as_str().unwrap_or_default(),
            payload["waited_ms"]
        ),
        "tool.outcome_unknown" => writeln!(
            out,
            "  {}: outcome unknown (attempt {}): {}",
            payload["tool"].as_str().unwrap_or_default(),
            payload["attempt"],
            payload["reason"].as_str().unwrap_or_default()
        ),
        "reconciliation.required" => writeln!(
            out,
            "  waiting for a human to reconcile {}",
            payload["request"]
        ),
        "subagent.started" => writeln!(
            out,
            "  -> {} {}: {}",
            payload["agent"].as_str().unwrap_or("agent"),
            payload["child_run_id"].as_str().unwrap_or_default(),
            payload["task"].as_str().unwrap_or_default()
        ),
        "subagent.finished" => writeln!(
            out,
            "  <- {} {} {}",
            payload["agent"].as_str().unwrap_or("agent"),
            payload["child_run_id"].as_str().unwrap_or_default(),
            payload["status"].as_str().unwrap_or_default()
        ),
        _ => Ok(()),
    };
    let _ = out.flush();
}

fn print_report(report: &RunReport, json: bool, answer_only: bool) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    if json {
        writeln!(stdout, "{}", serde_json::to_string(report)?)?;
    } else if answer_only && report.status == RunStatus::Completed {
        writeln!(
            stdout,
            "{}",
            report.final_answer.as_deref().unwrap_or_default()
        )?;
    } else {
        let reason = report.stop_reason.map_or("-".to_owned(), |r| r.to_string());
        writeln!(
            stdout,
            "{} {} ({reason}) after {} steps",
            report.run_id, report.status, report.steps
        )?;
        if let Some(answer) = &report.final_answer {
            writeln!(stdout, "{answer}")?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ratchet_core::{EventDraft, EventKind};
    use serde_json::json;

    use super::*;
    use ratchet::open_store;

    /// Events of the driven session can be published out of order, or — when another process
    /// executes a step — not on this process's bus at all: the feed takes each exactly once,
    /// in `seq` order, from the store when the bus does not bring it in turn.
    #[tokio::test]
    async fn the_feed_takes_each_event_once_in_order_whoever_published_it() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("r.db").display());
        let store = open_store(&url, Schema::Migrate).unwrap();
        let session = SessionId::from_suffix("s").unwrap();
        store
            .create_session(&session, SessionSpec::default(), 1)
            .await
            .unwrap();
        let run = RunId::from_suffix("r").unwrap();
        let append = |n: usize| {
            let drafts = (0..n)
                .map(|i| EventDraft::new(EventKind::Activity, json!({"i": i})))
                .collect();
            let store = Arc::clone(&store);
            let (session, run) = (session.clone(), run.clone());
            async move {
                store
                    .append_events(&session, &run, drafts, 1)
                    .await
                    .unwrap()
            }
        };
        let seqs = |events: Vec<StoredEvent>| events.iter().map(|e| e.seq).collect::<Vec<_>>();
        let mut feed = SessionFeed {
            session: session.clone(),
            seen: 0,
        };
        let stored = append(3).await;

        let taken = feed.next(store.as_ref(), Some(Ok(stored[2].clone()))).await;
        assert_eq!(seqs(taken.unwrap()), [1, 2, 3], "a gap is filled first");
        for late in [&stored[0], &stored[2]] {
            let taken = feed.next(store.as_ref(), Some(Ok(late.clone()))).await;
            assert_eq!(seqs(taken.unwrap()), [0; 0], "never twice");
        }
        append(2).await;
        let quiet = feed.next(store.as_ref(), None).await;
        assert_eq!(seqs(quiet.unwrap()), [4, 5], "unpublished events are found");
        let next = append(1).await;
        let taken = feed.next(store.as_ref(), Some(Ok(next[0].clone()))).await;
        assert_eq!(
            seqs(taken.unwrap()),
            [6],
            "the next one in turn, as it came"
        );
    }
}
