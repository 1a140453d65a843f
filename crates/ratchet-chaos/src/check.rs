//! The invariants of DESIGN.md §10, checked after the chaos from the database (through the
//! store, as the runtime itself reads it) and from what the clients received. Each finding is
//! a sentence naming the invariant, the session or run, what was expected and what was found.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::time::Instant;

use ratchet_core::{InboxStatus, RunStatus, SessionId, Visibility};
use ratchet_store::{InboxEvent, Reads, StoredEvent};
use serde_json::Value;

use crate::client::{RunLog, SessionLog};
use crate::mcp_log::{self, Execution, ExecutionKind};
use crate::model::{RoundAsked, SUMMARY_MARK, TRIGGER_PREFIX, trigger_events};
use crate::plan::{GATED_DIR, LOG_DIR, MCP_SERVER, NEVER_TOOLS, parse_call_id, told_in};

/// What the checks counted, besides the violations.
#[derive(Debug, Default)]
pub struct Tally {
    pub runs: usize,
    pub steps: usize,
    pub events: usize,
    pub hidden_messages: usize,
    pub appends: usize,
    /// Calls the chaos MCP server executed, by tool.
    pub mcp_executions: BTreeMap<String, usize>,
    /// Retries of `keyed` calls the server answered from their first execution.
    pub keyed_replays: usize,
    /// Calls a human had to answer for before their run could go on.
    pub calls_in_doubt: usize,
    pub stop_reasons: BTreeMap<String, usize>,
    /// How often the paths that chaos should reach were taken.
    pub events_of_kind: BTreeMap<&'static str, usize>,
    /// Helper runs the dispatchers' background delegations started.
    pub children: usize,
    /// Reports told by a completed continuation, and reports dead-lettered.
    pub reports_told: usize,
    pub reports_dead: usize,
    /// Messages sent with `multitask: "interrupt"`.
    pub interrupts: usize,
    /// Messages sent again under their key after no answer came, and messages answered with
    /// a kept response.
    pub message_resends: usize,
    pub message_replays: usize,
    /// Durable timers set, and those ended early by input.
    pub timers_set: usize,
    pub timers_woken_by_input: usize,
    /// Slots the chaos schedule fired, each one run.
    pub scheduled_slots: usize,
    /// Runs whose batch a cancel cut off (their ending step closed it), and cancelled runs
    /// whose ending step a `ratchet worker` process committed, the cancel having gone to the
    /// API process.
    pub cut_off_batches: usize,
    pub cancels_across_processes: usize,
    /// Results that told the model a call was not run (each of a call that never started).
    pub told_not_run: usize,
    /// Schedules and webhooks created under a key during the kills, and how often one was
    /// sent again after no answer came.
    pub keyed_creations: usize,
    pub keyed_creation_resends: usize,
}

/// The event kinds counted in the tally: each is a path the workload is meant to exercise.
const COUNTED_KINDS: [&str; 5] = [
    "approval.required",
    "tool.outcome_unknown",
    "reconciliation.required",
    "context.compacted",
    "run.resumed",
];

/// What the chaos saw besides the database: the clients' logs, the workspace the tools wrote
/// to, the chaos MCP server's record of its executions, and the model's requests.
pub struct Evidence<'a> {
    pub logs: &'a [SessionLog],
    pub workspace: &'a Path,
    pub mcp_log: &'a Path,
    pub rounds_asked: &'a [RoundAsked],
    /// The calls a model request's tool results said were not run, by id.
    pub told_not_run: &'a [String],
    pub worker_pids: &'a [u32],
}

pub async fn check(
    store: &dyn Reads,
    evidence: &Evidence<'_>,
) -> anyhow::Result<(Tally, Vec<String>)> {
    let Evidence {
        logs,
        workspace,
        mcp_log,
        rounds_asked,
        told_not_run,
        worker_pids,
    } = *evidence;
    let mut started_calls: HashMap<String, String> = HashMap::new();
    let rounds_asked = rounds_by_tag(rounds_asked);
    let mut tally = Tally::default();
    let mut violations = Vec::new();
    let with_jobs: HashSet<String> = store
        .runs_with_jobs()
        .await?
        .iter()
        .map(ToString::to_string)
        .collect();
    for log in logs.iter().filter(|log| !log.session_id.is_empty()) {
        let session_id = SessionId::parse(&log.session_id)
            .map_err(|e| anyhow::anyhow!("session id {:?}: {e}", log.session_id))?;
        let events = all_events(store, &session_id).await?;
        tally.events += events.len();
        for kind in COUNTED_KINDS {
            *tally.events_of_kind.entry(kind).or_default() +=
                events.iter().filter(|e| e.kind == kind).count();
        }
        check_event_log(log, &events, &mut violations);
        check_one_active_run(&log.session_id, &events, &mut violations);
        for event in events.iter().filter(|e| e.kind == "tool.call") {
            if let Some(call) = event.payload["call_id"].as_str() {
                started_calls.insert(call.to_owned(), log.session_id.clone());
            }
        }
        let session = store.get_session(&session_id).await?;
        if let Some(active) = session.active_run_id {
            violations.push(format!(
                "invariant 3: session {} still has active run {active} after the chaos settled",
                log.session_id
            ));
        }
        for run in &log.runs {
            let run_id = ratchet_core::RunId::parse(&run.run_id)
                .map_err(|e| anyhow::anyhow!("run id {:?}: {e}", run.run_id))?;
            let state = store.load_state(&run_id).await?;
            let steps = store.steps(&run_id).await?;
            tally.runs += 1;
            tally.steps += steps.len();
            let run_events: Vec<&StoredEvent> = events
                .iter()
                .filter(|e| e.run_id.as_ref() == Some(&run_id))
                .collect();
            let name = &run.run_id;

            // 2: dense step indexes, each committed once.
            let indexes: Vec<u64> = steps.iter().map(|s| s.index).collect();
            let expected: Vec<u64> = (1..=state.step_index).collect();
            if indexes != expected {
                violations.push(format!(
                    "invariant 2: run {name} has steps {indexes:?}, expected 1..={}",
                    state.step_index
                ));
            }
            let committed: Vec<u64> = run_events
                .iter()
                .filter(|e| e.kind == "step.committed")
                .filter_map(|e| e.payload["step_index"].as_u64())
                .collect();
            if committed != expected {
                violations.push(format!(
                    "invariant 2: run {name} announced step.committed for {committed:?}, expected 1..={}",
                    state.step_index
                ));
            }

            // 3: nothing stranded.
            if !state.status.is_terminal() {
                violations.push(format!(
                    "invariant 3: run {name} is {} after the chaos settled",
                    state.status
                ));
            }
            if state.status.is_terminal() && with_jobs.contains(name) {
                violations.push(format!(
                    "invariant 3: run {name} is {} but still has a job",
                    state.status
                ));
            }
            if !run.finished {
                violations.push(format!(
                    "invariant 3: the client never saw run {name} finish"
                ));
            }

            // 5: no model call while a call of the run is in doubt.
            let asked = rounds_asked
                .get(run.tag.as_str())
                .map_or(&[][..], Vec::as_slice);
            tally.calls_in_doubt +=
                check_model_waits_for_answers(run, &run_events, asked, &mut violations);

            // 22: a message sent again under its key started no second run.
            check_one_run_per_message(run, &events, &mut violations);

            // 22: every wait set ends once, never before its due time unless input woke it.
            check_timers(name, &run_events, state.status, &mut tally, &mut violations);

            // 7: the frozen configuration never changed.
            let config_now = serde_json::to_value(&*state.config)?;
            if config_now != run.config_at_start {
                violations.push(format!(
                    "invariant 7: run {name}'s configuration changed from {} to {config_now}",
                    run.config_at_start
                ));
            }

            if state.stop_reason == Some(ratchet_core::StopReason::Cancelled) {
                count_cancel(&run_events, worker_pids, &mut tally);
            }

            // 8: one stop reason and a finish time; one run.finished per start or resume.
            if state.status.is_terminal() {
                match (state.stop_reason, state.finished_at) {
                    (Some(reason), Some(_)) => {
                        *tally.stop_reasons.entry(reason.to_string()).or_default() += 1;
                    }
                    (reason, finished_at) => violations.push(format!(
                        "invariant 8: terminal run {name} has stop reason {reason:?} and finished_at {finished_at:?}"
                    )),
                }
                let count = |kind: &str| run_events.iter().filter(|e| e.kind == kind).count();
                let (finished, resumed) = (count("run.finished"), count("run.resumed"));
                if finished != resumed + 1 {
                    violations.push(format!(
                        "invariant 8: run {name} has {finished} run.finished events for {resumed} resumes, expected {}",
                        resumed + 1
                    ));
                }
                let last_reason = run_events
                    .iter()
                    .rev()
                    .find(|e| e.kind == "run.finished")
                    .map(|e| e.payload["stop_reason"].clone());
                let reason = state.stop_reason.map(|r| Value::String(r.to_string()));
                if last_reason.is_some() && last_reason != reason {
                    violations.push(format!(
                        "invariant 8: run {name} ended {reason:?} but its last run.finished says {last_reason:?}"
                    ));
                }
            }
        }
        tally.message_resends += log.message_resends;
        tally.message_replays += log.message_replays;
        check_history(store, &session_id, &mut tally, &mut violations).await?;
        check_children(store, log, &mut tally, &mut violations).await?;
        if log.delegating {
            tally.interrupts += log.interrupts;
            check_inbox(store, &session_id, &mut tally, &mut violations).await?;
        }
    }
    check_effects(workspace, &mut tally, &mut violations)?;
    let (executions, strays) = mcp_log::read(mcp_log)?;
    for stray in strays {
        violations.push(format!(
            "invariant 5: {} holds {stray:?}, which the server did not write",
            mcp_log.display()
        ));
    }
    check_mcp_executions(&executions, &mut tally, &mut violations);
    check_told_not_run(told_not_run, &started_calls, &mut tally, &mut violations);
    Ok((tally, violations))
}

/// Invariant 24: no call that started is told it was not run — neither in a model request
/// (what the model was sent, dangling calls answered included) nor in the stored history.
/// A call started when a `tool.call` event names it.
fn check_told_not_run(
    told_not_run: &[String],
    started: &HashMap<String, String>,
    tally: &mut Tally,
    violations: &mut Vec<String>,
) {
    tally.told_not_run += told_not_run.len();
    let mut reported = HashSet::new();
    for call in told_not_run {
        if let Some(session) = started.get(call)
            && reported.insert(call)
        {
            violations.push(format!(
                "invariant 24: session {session}: call {call} started (a tool.call names it), yet the model was told it was not run"
            ));
        }
    }
}

/// What a cancelled run's end tells: whether a cancel cut a batch off (its ending step closed
/// the batch, telling the model what became of each call), and whether that step ran in a
/// `ratchet worker` process while the cancel went to the API process.
fn count_cancel(run_events: &[&StoredEvent], worker_pids: &[u32], tally: &mut Tally) {
    let closed = run_events.iter().any(|e| {
        e.kind == "tool.result"
            && e.payload["content"]
                .as_str()
                .is_some_and(|c| c.contains("the run was cancelled") || c == "cancelled")
    });
    tally.cut_off_batches += usize::from(closed);
    let last_worker = (run_events.iter().rev())
        .find(|e| e.kind == "step.committed")
        .and_then(|e| e.payload["worker"].as_str())
        .and_then(|owner| owner.split(':').nth(1))
        .and_then(|pid| pid.parse::<u32>().ok());
    if last_worker.is_some_and(|pid| worker_pids.contains(&pid)) {
        tally.cancels_across_processes += 1;
    }
}

/// Invariant 22: a timer set (`timer.set`) is woken exactly once (`timer.woke`) unless its
/// run was stopped while it waited, and a wake by the timer comes at its due time or after.
fn check_timers(
    run: &str,
    events: &[&StoredEvent],
    status: RunStatus,
    tally: &mut Tally,
    violations: &mut Vec<String>,
) {
    let of_kind = |kind: &str| -> Vec<&StoredEvent> {
        events.iter().copied().filter(|e| e.kind == kind).collect()
    };
    let (set, woke) = (of_kind("timer.set"), of_kind("timer.woke"));
    tally.timers_set += set.len();
    let stopped = matches!(status, RunStatus::Cancelled | RunStatus::Failed);
    for timer in &set {
        let call = &timer.payload["call_id"];
        let wakes: Vec<&&StoredEvent> = woke
            .iter()
            .filter(|w| &w.payload["call_id"] == call && w.seq > timer.seq)
            .collect();
        match wakes[..] {
            [] if stopped => {}
            [wake] => {
                let due = timer.payload["due_at"].as_i64().unwrap_or(i64::MAX);
                match wake.payload["woke"].as_str() {
                    Some("input") => tally.timers_woken_by_input += 1,
                    Some("timer") if wake.created_at >= due => {}
                    other => violations.push(format!(
                        "invariant 22: run {run}'s wait {call} woke ({other:?}) at {}, before its due time {due}",
                        wake.created_at
                    )),
                }
            }
            _ => violations.push(format!(
                "invariant 22: run {run}'s wait {call} (set at seq {}) was woken {} times; the run is {status}",
                timer.seq,
                wakes.len()
            )),
        }
    }
    if woke.len() > set.len() {
        violations.push(format!(
            "invariant 22: run {run} has {} timer.woke events for {} timers set",
            woke.len(),
            set.len()
        ));
    }
}

/// What was created under a key during the kills: each schedule's message and each webhook's
/// URL, with the id its answer named.
#[derive(Debug, Default)]
pub struct KeyedCreations {
    pub schedules: Vec<(String, String)>,
    pub webhooks: Vec<(String, String)>,
    pub resends: usize,
}

/// Invariant 23 across kills: each keyed creation, however often it was sent again, made one
/// schedule or webhook — the one its answer named.
pub async fn check_keyed_creations(
    store: &dyn Reads,
    created: &KeyedCreations,
    webhooks: &[Value],
    tally: &mut Tally,
    violations: &mut Vec<String>,
) -> anyhow::Result<()> {
    let mut schedules = Vec::new();
    loop {
        let after = schedules
            .last()
            .map(|s: &ratchet_store::Schedule| s.id.clone());
        let page = (store.schedules(ratchet_store::DEFAULT_TENANT, after.as_ref(), 200)).await?;
        if page.is_empty() {
            break;
        }
        schedules.extend(page);
    }
    for (message, id) in &created.schedules {
        let made: Vec<&str> = (schedules.iter())
            .filter(|s| s.spec.message == *message)
            .map(|s| s.id.as_str())
            .collect();
        if made != [id.as_str()] {
            violations.push(format!(
                "invariant 23: the keyed schedule {message:?} made {made:?}, expected only the one its answer named ({id})"
            ));
        }
    }
    for (url, id) in &created.webhooks {
        let made: Vec<&str> = (webhooks.iter())
            .filter(|w| w["url"] == url.as_str())
            .filter_map(|w| w["id"].as_str())
            .collect();
        if made != [id.as_str()] {
            violations.push(format!(
                "invariant 23: the keyed webhook to {url} made {made:?}, expected only the one its answer named ({id})"
            ));
        }
    }
    tally.keyed_creations = created.schedules.len() + created.webhooks.len();
    tally.keyed_creation_resends = created.resends;
    Ok(())
}

/// The runs the chaos schedule fired (`RunSummary::schedule_id` is `schedule`): each slot
/// fired at most once, each run ended, and — its catch-up being `all` — no slot lost between
/// the first and the last fired.
pub async fn check_schedule(
    store: &dyn Reads,
    schedule: &str,
    every_ms: i64,
    tally: &mut Tally,
    violations: &mut Vec<String>,
) -> anyhow::Result<()> {
    let runs = store.list_runs().await?;
    let mut by_slot: BTreeMap<i64, Vec<String>> = BTreeMap::new();
    for run in runs.iter().filter(|r| {
        r.schedule_id
            .as_ref()
            .is_some_and(|id| id.as_str() == schedule)
    }) {
        let slot = run.slot.unwrap_or_default();
        by_slot
            .entry(slot)
            .or_default()
            .push(run.run_id.to_string());
        if !run.status.is_terminal() {
            violations.push(format!(
                "invariant 3: scheduled run {} (slot {slot}) is {} after the chaos settled",
                run.run_id, run.status
            ));
        }
    }
    tally.scheduled_slots = by_slot.len();
    for (slot, runs) in &by_slot {
        if runs.len() > 1 {
            violations.push(format!(
                "schedules: slot {slot} of {schedule} fired {} runs: {runs:?}",
                runs.len()
            ));
        }
    }
    let slots: Vec<i64> = by_slot.keys().copied().collect();
    for pair in slots.windows(2) {
        if pair[1] - pair[0] != every_ms {
            violations.push(format!(
                "schedules: {schedule} fired slot {} then {}, expected every {every_ms} ms in between (catch_up all)",
                pair[0], pair[1]
            ));
        }
    }
    Ok(())
}

/// Invariant 23: the run's message, sent under its `Idempotency-Key` until answered, created
/// exactly one run — the one the client was answered with.
fn check_one_run_per_message(run: &RunLog, events: &[StoredEvent], violations: &mut Vec<String>) {
    let created: Vec<String> = events
        .iter()
        .filter(|e| {
            e.kind == "run.created" && e.payload["content"].as_str() == Some(run.message.as_str())
        })
        .map(|e| {
            e.run_id
                .as_ref()
                .map_or_else(String::new, ToString::to_string)
        })
        .collect();
    if created != [run.run_id.as_str()] {
        violations.push(format!(
            "invariant 23: the message of run {} ({}) created runs {created:?}, expected it alone",
            run.run_id, run.tag
        ));
    }
}

/// The model's requests for each plan, in the order received.
fn rounds_by_tag(rounds_asked: &[RoundAsked]) -> HashMap<&str, Vec<RoundAsked>> {
    let mut by_tag: HashMap<&str, Vec<RoundAsked>> = HashMap::new();
    for asked in rounds_asked {
        by_tag.entry(&asked.tag).or_default().push(asked.clone());
    }
    by_tag
}

/// 5, seen by the model: once a call's outcome is unknown — a `never` call cut off
/// (`tool.outcome_unknown`) or any call a human is asked about (`reconciliation.required`) —
/// the model is not asked for the next round of that run before the client first sent its
/// answer. A request that came earlier would have offered the model a batch whose effect
/// nobody knew, or run without it. Returns how many calls were in doubt.
fn check_model_waits_for_answers(
    run: &RunLog,
    run_events: &[&StoredEvent],
    asked: &[RoundAsked],
    violations: &mut Vec<String>,
) -> usize {
    let mut in_doubt: Vec<&str> = Vec::new();
    for event in run_events {
        match event.kind.as_str() {
            "tool.outcome_unknown"
                if event.payload["tool"]
                    .as_str()
                    .is_some_and(|tool| NEVER_TOOLS.contains(&tool)) =>
            {
                in_doubt.extend(event.payload["call_id"].as_str());
            }
            "reconciliation.required" => in_doubt.extend(
                event.payload["request"]["calls"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|call| call["call_id"].as_str()),
            ),
            _ => {}
        }
    }
    in_doubt.sort_unstable();
    in_doubt.dedup();
    for call_id in &in_doubt {
        let Some((_, round, _)) = parse_call_id(call_id) else {
            violations.push(format!(
                "invariant 5: run {} has call {call_id:?} in doubt, which no plan made",
                run.run_id
            ));
            continue;
        };
        let answered: Option<Instant> = (run.reconciled.iter())
            .filter(|(id, _)| id == call_id)
            .map(|(_, at)| *at)
            .min();
        let too_early = asked
            .iter()
            .find(|a| a.round > round && answered.is_none_or(|answered| a.at < answered));
        if let Some(early) = too_early {
            let when = if answered.is_some() {
                "before its answer was sent"
            } else {
                "and it was never answered"
            };
            violations.push(format!(
                "invariant 5: run {}'s call {call_id} was in doubt, yet the model was asked for round {} {when}",
                run.run_id, early.round
            ));
        }
    }
    in_doubt.len()
}

/// 5, seen by the chaos MCP server: no `never` call's idempotency key executed twice; a
/// `keyed` call is retried under one key only, and that key did its work once.
fn check_mcp_executions(executions: &[Execution], tally: &mut Tally, violations: &mut Vec<String>) {
    let never_tools: Vec<&str> = NEVER_TOOLS
        .iter()
        .filter_map(|tool| tool.strip_prefix(&format!("{MCP_SERVER}.")))
        .collect();
    let mut done: HashSet<&str> = HashSet::new();
    let mut key_of_line: HashMap<&str, &str> = HashMap::new();
    let mut rekeyed: HashSet<&str> = HashSet::new();
    for execution in executions {
        let Execution {
            kind,
            tool,
            key,
            line,
        } = execution;
        if *kind == ExecutionKind::Replay {
            tally.keyed_replays += 1;
        } else {
            *tally.mcp_executions.entry(tool.clone()).or_default() += 1;
            if !done.insert(key) {
                let policy = if never_tools.contains(&tool.as_str()) {
                    "never"
                } else {
                    "keyed"
                };
                violations.push(format!(
                    "invariant 5: the {policy} call {line} ({MCP_SERVER}.{tool}) was executed twice under key {key}"
                ));
            }
        }
        let first_key = *key_of_line.entry(line).or_insert(key);
        if first_key != key && rekeyed.insert(line) {
            violations.push(format!(
                "invariant 5: call {line} ({MCP_SERVER}.{tool}) was sent under key {first_key}, then under {key}"
            ));
        }
    }
}

async fn all_events(store: &dyn Reads, session: &SessionId) -> anyhow::Result<Vec<StoredEvent>> {
    let mut events: Vec<StoredEvent> = Vec::new();
    loop {
        let after = events.last().map_or(0, |e| e.seq);
        let page = store.events_after(session, after, 1000).await?;
        if page.is_empty() {
            return Ok(events);
        }
        events.extend(page);
    }
}

/// 4: the stored log is gap-free, and what the client received — across every reconnect —
/// is exactly its first events, in order, each as stored (an event published before its
/// commit and then lost with a crash would differ or be missing).
fn check_event_log(log: &SessionLog, stored: &[StoredEvent], violations: &mut Vec<String>) {
    let session = &log.session_id;
    let seqs: Vec<i64> = stored.iter().map(|e| e.seq).collect();
    if seqs.iter().enumerate().any(|(i, seq)| *seq != i as i64 + 1) {
        violations.push(format!(
            "invariant 4: session {session}'s stored seqs are not 1..={}: {seqs:?}",
            seqs.len()
        ));
        return;
    }
    for (i, received) in log.events.iter().enumerate() {
        let expected_seq = i as i64 + 1;
        if received.seq != expected_seq {
            violations.push(format!(
                "invariant 4: session {session}'s client received seq {} where {expected_seq} was due (a gap or a repeat)",
                received.seq
            ));
            return;
        }
        let Some(stored) = stored.get(i) else {
            violations.push(format!(
                "invariant 4: session {session}'s client received seq {expected_seq}, which the database does not have"
            ));
            return;
        };
        let stored_run = stored.run_id.as_ref().map(ToString::to_string);
        if received.kind != stored.kind
            || received.run_id != stored_run
            || received.payload != stored.payload
        {
            violations.push(format!(
                "invariant 4: session {session} seq {expected_seq}: the client received {} {}, the database has {} {}",
                received.kind, received.payload, stored.kind, stored.payload
            ));
        }
        if received.payload.to_string().contains(SUMMARY_MARK) {
            violations.push(format!(
                "invariant 10: session {session} seq {expected_seq} carried a hidden summary to the client"
            ));
        }
    }
}

/// 1: within a session, a run holds it from its first step or holding status to its last
/// step or status event, and these spans of different runs never overlap. A run that ends
/// while queued (cancelled behind another) never held the session.
fn check_one_active_run(session: &str, events: &[StoredEvent], violations: &mut Vec<String>) {
    let mut spans: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    for event in events {
        let Some(run) = event.run_id.as_ref().map(ToString::to_string) else {
            continue;
        };
        let status = event.payload["status"].as_str();
        let ends = match event.kind.as_str() {
            "run.status" => status
                .and_then(RunStatus::parse)
                .map(RunStatus::is_terminal),
            "step.committed" => Some(false),
            "run.finished" => Some(true),
            _ => None,
        };
        match ends {
            Some(false) if status != Some("queued") => {
                let span = spans.entry(run).or_insert((event.seq, event.seq));
                span.1 = event.seq;
            }
            Some(true) => {
                if let Some(span) = spans.get_mut(&run) {
                    span.1 = event.seq;
                }
            }
            _ => {}
        }
    }
    let mut spans: Vec<(i64, i64, String)> = spans
        .into_iter()
        .map(|(run, (from, to))| (from, to, run))
        .collect();
    spans.sort();
    for pair in spans.windows(2) {
        let (_, end, earlier) = &pair[0];
        let (start, _, later) = &pair[1];
        if start <= end {
            violations.push(format!(
                "invariant 1: session {session}: run {later} is active from seq {start} while run {earlier} is active until seq {end}"
            ));
        }
    }
}

/// 6 and 10 from the stored history: every batch's results follow it in call order; the
/// messages a client can read contain no hidden one.
async fn check_history(
    store: &dyn Reads,
    session_id: &SessionId,
    tally: &mut Tally,
    violations: &mut Vec<String>,
) -> anyhow::Result<()> {
    let history = store.history(session_id).await?;
    for (i, message) in history.iter().enumerate() {
        if message.tool_calls.is_empty() {
            continue;
        }
        let results: Vec<&str> = history[i + 1..]
            .iter()
            .take_while(|m| m.role == ratchet_core::Role::Tool)
            .map(|m| m.tool_call_id.as_deref().unwrap_or_default())
            .collect();
        let calls: Vec<&str> = message.tool_calls.iter().map(|c| c.id.as_str()).collect();
        if !calls.starts_with(&results) {
            violations.push(format!(
                "invariant 6: session {session_id}: results {results:?} do not follow the calls {calls:?} in order"
            ));
        }
    }
    tally.hidden_messages += history
        .iter()
        .filter(|m| m.visibility == Visibility::Hidden)
        .count();
    let visible = store.visible_messages(session_id, 0, 10_000).await?;
    for stored in visible {
        if stored.message.visibility == Visibility::Hidden
            || stored.message.content.contains(SUMMARY_MARK)
        {
            violations.push(format!(
                "invariant 10: session {session_id}: hidden message {} is in client history",
                stored.id
            ));
        }
    }
    Ok(())
}

/// 3, below the clients' runs: every run their delegations started has ended.
async fn check_children(
    store: &dyn Reads,
    log: &SessionLog,
    tally: &mut Tally,
    violations: &mut Vec<String>,
) -> anyhow::Result<()> {
    for run in &log.runs {
        let run_id = ratchet_core::RunId::parse(&run.run_id)
            .map_err(|e| anyhow::anyhow!("run id {:?}: {e}", run.run_id))?;
        for node in store.run_tree(&run_id).await?.iter().skip(1) {
            tally.children += 1;
            if !node.status.is_terminal() {
                violations.push(format!(
                    "invariant 3: run {}, started by {}, is {} after the chaos settled",
                    node.run_id, run.run_id, node.status
                ));
            }
        }
    }
    Ok(())
}

/// 15: every report of a dispatcher's session reached exactly one completed continuation or
/// the dead letter — never both, never twice. A consumed report's trigger, the first step of
/// the turn that told it and that turn's answer are each in the history once, and the run
/// that consumed it is a continuation that completed; a dead-lettered one's are nowhere (a
/// failed continuation's messages never reach the history).
async fn check_inbox(
    store: &dyn Reads,
    session_id: &SessionId,
    tally: &mut Tally,
    violations: &mut Vec<String>,
) -> anyhow::Result<()> {
    let mut reports: Vec<InboxEvent> = Vec::new();
    loop {
        let after = reports.last().map_or(0, |report| report.id);
        let page = store.inbox(session_id, None, after, 500).await?;
        if page.is_empty() {
            break;
        }
        reports.extend(page);
    }
    let (mut triggered, mut drafted, mut told) = (
        HashMap::<i64, usize>::new(),
        HashMap::<i64, usize>::new(),
        HashMap::<i64, usize>::new(),
    );
    for message in store.history(session_id).await? {
        let text = &message.content;
        let counted: (&mut HashMap<i64, usize>, Vec<i64>) = match message.role {
            ratchet_core::Role::User if text.starts_with(TRIGGER_PREFIX) => {
                (&mut triggered, trigger_events(text))
            }
            ratchet_core::Role::Assistant if !told_in(text).is_empty() => {
                (&mut told, told_in(text))
            }
            ratchet_core::Role::Assistant => {
                let tag = (text.split_once("of plan "))
                    .and_then(|(_, rest)| rest.split(':').next())
                    .unwrap_or_default();
                (&mut drafted, crate::plan::told(tag).unwrap_or_default())
            }
            _ => continue,
        };
        for event in counted.1 {
            *counted.0.entry(event).or_default() += 1;
        }
    }
    for report in &reports {
        let id = report.id;
        let count = |of: &HashMap<i64, usize>| of.get(&id).copied().unwrap_or(0);
        let seen = (count(&triggered), count(&drafted), count(&told));
        let said = format!(
            "its trigger is in the history {} times, its turn's first step {} times and its turn's answer {} times",
            seen.0, seen.1, seen.2
        );
        match report.status {
            InboxStatus::Consumed => {
                tally.reports_told += 1;
                if seen != (1, 1, 1) {
                    violations.push(format!(
                        "invariant 15: session {session_id}'s report {id} was consumed, yet {said}; expected once each"
                    ));
                }
                let consumer = match &report.lease_run_id {
                    Some(run) => Some(store.load_state(run).await?),
                    None => None,
                };
                let completed = consumer.as_ref().is_some_and(|run| {
                    run.config.continuation && run.status == ratchet_core::RunStatus::Completed
                });
                if !completed {
                    violations.push(format!(
                        "invariant 15: session {session_id}'s report {id} was consumed by {:?}, which is not a completed continuation",
                        report.lease_run_id
                    ));
                }
            }
            InboxStatus::DeadLetter => {
                tally.reports_dead += 1;
                if seen != (0, 0, 0) {
                    violations.push(format!(
                        "invariant 15: session {session_id}'s report {id} went to the dead letter, yet {said}"
                    ));
                }
            }
            other => violations.push(format!(
                "invariant 15: session {session_id}'s report {id} is {} after the chaos settled",
                other.as_str()
            )),
        }
    }
    Ok(())
}

/// 5: the effect of a `never`-replay call (a line in a file) happened at most once.
fn check_effects(
    workspace: &Path,
    tally: &mut Tally,
    violations: &mut Vec<String>,
) -> anyhow::Result<()> {
    let mut seen = HashSet::new();
    for dir in [LOG_DIR, GATED_DIR] {
        let Ok(entries) = std::fs::read_dir(workspace.join(dir)) else {
            continue;
        };
        for entry in entries {
            let path = entry?.path();
            for line in std::fs::read_to_string(&path)?.lines() {
                tally.appends += 1;
                if parse_call_id(line).is_none() {
                    violations.push(format!(
                        "invariant 5: {} holds {line:?}, which no call wrote",
                        path.display()
                    ));
                } else if !seen.insert(line.to_owned()) {
                    violations.push(format!(
                        "invariant 5: the never-replay call {line} took effect twice ({})",
                        path.display()
                    ));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use ratchet_core::RunId;
    use serde_json::json;

    use super::*;
    use crate::client::ClientEvent;

    fn stored(seq: i64, run: &str, kind: &str, payload: Value) -> StoredEvent {
        StoredEvent {
            session_id: SessionId::from_suffix("s").unwrap(),
            seq,
            run_id: Some(RunId::from_suffix(run).unwrap()),
            kind: kind.into(),
            payload,
            created_at: 0,
        }
    }

    fn received(event: &StoredEvent) -> ClientEvent {
        ClientEvent {
            seq: event.seq,
            kind: event.kind.clone(),
            run_id: event.run_id.as_ref().map(ToString::to_string),
            payload: event.payload.clone(),
        }
    }

    fn log_of(events: Vec<ClientEvent>) -> SessionLog {
        SessionLog {
            session_id: "ses_s".into(),
            events,
            ..SessionLog::default()
        }
    }

    fn status(seq: i64, run: &str, status: &str) -> StoredEvent {
        stored(seq, run, "run.status", json!({"status": status}))
    }

    #[test]
    fn a_client_log_that_is_the_stored_prefix_passes() {
        let events: Vec<StoredEvent> = (1..=3).map(|s| status(s, "a", "running")).collect();
        let mut violations = Vec::new();
        check_event_log(
            &log_of(vec![received(&events[0]), received(&events[1])]),
            &events,
            &mut violations,
        );
        assert_eq!(violations, Vec::<String>::new());
    }

    #[test]
    fn gaps_repeats_and_differences_in_what_a_client_received_are_violations() {
        let events: Vec<StoredEvent> = (1..=3).map(|s| status(s, "a", "running")).collect();
        let cases = [
            vec![received(&events[0]), received(&events[2])],
            vec![received(&events[0]), received(&events[0])],
            vec![ClientEvent {
                payload: json!({"status": "failed"}),
                ..received(&events[0])
            }],
            vec![
                received(&events[0]),
                received(&events[1]),
                received(&events[2]),
                ClientEvent {
                    seq: 4,
                    ..received(&events[2])
                },
            ],
        ];
        for case in cases {
            let mut violations = Vec::new();
            check_event_log(&log_of(case.clone()), &events, &mut violations);
            assert_eq!(violations.len(), 1, "{case:?}: {violations:?}");
            assert!(violations[0].starts_with("invariant 4"), "{violations:?}");
        }
    }

    #[test]
    fn a_gap_in_the_stored_log_is_a_violation() {
        let events = vec![status(1, "a", "running"), status(3, "a", "completed")];
        let mut violations = Vec::new();
        check_event_log(&log_of(Vec::new()), &events, &mut violations);
        assert_eq!(violations.len(), 1);
    }

    #[test]
    fn runs_one_after_the_other_pass_and_overlapping_runs_do_not() {
        let sequential = vec![
            status(1, "a", "queued"),
            status(2, "a", "running"),
            stored(3, "a", "step.committed", json!({})),
            stored(4, "b", "run.created", json!({})),
            status(5, "b", "queued"),
            status(6, "a", "completed"),
            stored(7, "a", "run.finished", json!({})),
            status(8, "b", "running"),
            stored(9, "b", "step.committed", json!({})),
            // Queued behind b and cancelled there: c never held the session.
            status(10, "c", "queued"),
            status(11, "c", "cancelled"),
            stored(12, "c", "run.finished", json!({})),
            stored(13, "b", "step.committed", json!({})),
        ];
        let mut violations = Vec::new();
        check_one_active_run("ses_s", &sequential, &mut violations);
        assert_eq!(violations, Vec::<String>::new());

        let overlapping = vec![
            status(1, "a", "running"),
            status(2, "b", "running"),
            stored(3, "a", "step.committed", json!({})),
        ];
        check_one_active_run("ses_s", &overlapping, &mut violations);
        assert_eq!(violations.len(), 1);
        assert!(violations[0].starts_with("invariant 1"), "{violations:?}");
    }

    #[test]
    fn a_wait_woken_once_at_or_after_its_due_time_passes_and_anything_else_does_not() {
        let set = |seq| {
            stored(
                seq,
                "a",
                "timer.set",
                json!({"call_id": "w", "due_at": 100}),
            )
        };
        let woke = |seq, at, by: &str| {
            let mut event = stored(seq, "a", "timer.woke", json!({"call_id": "w", "woke": by}));
            event.created_at = at;
            event
        };
        let check = |events: Vec<StoredEvent>, status| {
            let (mut tally, mut violations) = (Tally::default(), Vec::new());
            let events: Vec<&StoredEvent> = events.iter().collect();
            check_timers("run_a", &events, status, &mut tally, &mut violations);
            violations
        };
        assert!(check(vec![set(1), woke(2, 100, "timer")], RunStatus::Completed).is_empty());
        assert!(check(vec![set(1), woke(2, 50, "input")], RunStatus::Completed).is_empty());
        assert!(
            check(vec![set(1)], RunStatus::Cancelled).is_empty(),
            "stopped while waiting"
        );
        for (events, why) in [
            (vec![set(1)], "a completed run's wait never woke"),
            (
                vec![set(1), woke(2, 99, "timer")],
                "woken by its timer before the due time",
            ),
            (
                vec![set(1), woke(2, 100, "timer"), woke(3, 101, "timer")],
                "woken twice",
            ),
        ] {
            let violations = check(events, RunStatus::Completed);
            assert!(!violations.is_empty(), "{why}");
            assert!(
                violations.iter().all(|v| v.starts_with("invariant 22")),
                "{why}: {violations:?}"
            );
        }
    }

    #[test]
    fn a_message_that_created_its_run_alone_passes_and_one_that_created_two_does_not() {
        let created = |seq, run: &str, content: &str| {
            stored(seq, run, "run.created", json!({"content": content}))
        };
        let run = RunLog {
            run_id: "run_a".into(),
            message: "hello".into(),
            ..run_log(Vec::new())
        };
        let once = vec![created(1, "a", "hello"), created(2, "b", "other")];
        let mut violations = Vec::new();
        check_one_run_per_message(&run, &once, &mut violations);
        assert_eq!(violations, Vec::<String>::new());

        let twice = vec![created(1, "a", "hello"), created(2, "b", "hello")];
        check_one_run_per_message(&run, &twice, &mut violations);
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert!(violations[0].starts_with("invariant 23"), "{violations:?}");

        let another = vec![created(1, "b", "hello")];
        let mut violations = Vec::new();
        check_one_run_per_message(&run, &another, &mut violations);
        assert_eq!(
            violations.len(),
            1,
            "the client was answered with another run"
        );
    }

    fn run_log(reconciled: Vec<(String, Instant)>) -> RunLog {
        RunLog {
            message: String::new(),
            run_id: "run_a".into(),
            tag: "t".into(),
            config_at_start: Value::Null,
            finished: true,
            reconciled,
        }
    }

    fn asked(round: usize, at: Instant) -> RoundAsked {
        RoundAsked {
            tag: "t".into(),
            round,
            at,
        }
    }

    fn unknown(seq: i64, tool: &str, call_id: &str) -> StoredEvent {
        stored(
            seq,
            "a",
            "tool.outcome_unknown",
            json!({"tool": tool, "call_id": call_id, "attempt": 1}),
        )
    }

    fn reconciliation(seq: i64, call_id: &str) -> StoredEvent {
        stored(
            seq,
            "a",
            "reconciliation.required",
            json!({"request": {"kind": "reconciliation", "calls": [{"call_id": call_id}]}}),
        )
    }

    #[test]
    fn the_model_asked_only_after_the_answer_to_a_call_in_doubt_passes() {
        let start = Instant::now();
        let at = |ms| start + std::time::Duration::from_millis(ms);
        let events = [
            unknown(1, "chaos.hang", "c-t-0-1"),
            reconciliation(2, "c-t-0-1"),
        ];
        let events: Vec<&StoredEvent> = events.iter().collect();
        let run = run_log(vec![("c-t-0-1".into(), at(10))]);
        let mut violations = Vec::new();
        let in_doubt = check_model_waits_for_answers(
            &run,
            &events,
            &[asked(0, at(0)), asked(1, at(11))],
            &mut violations,
        );
        assert_eq!((in_doubt, violations), (1, Vec::<String>::new()));
    }

    #[test]
    fn the_model_asked_again_while_a_call_is_in_doubt_is_a_violation() {
        let start = Instant::now();
        let at = |ms| start + std::time::Duration::from_millis(ms);
        let answered = run_log(vec![("c-t-0-1".into(), at(10))]);
        let unanswered = run_log(Vec::new());
        let never_unknown = [unknown(1, "chaos.hang", "c-t-0-1")];
        let reconciled = [reconciliation(1, "c-t-0-1")];
        let cases: [(&RunLog, &[StoredEvent]); 3] = [
            // Re-offered before the answer: after a never call's unknown outcome, and after
            // a reconciliation of any call (a crash, a keyed call out of attempts).
            (&answered, &never_unknown),
            (&answered, &reconciled),
            // The run went on although nobody ever answered.
            (&unanswered, &never_unknown),
        ];
        for (run, events) in cases {
            let events: Vec<&StoredEvent> = events.iter().collect();
            let mut violations = Vec::new();
            check_model_waits_for_answers(
                run,
                &events,
                &[asked(0, at(0)), asked(1, at(5))],
                &mut violations,
            );
            assert_eq!(violations.len(), 1, "{violations:?}");
            assert!(
                violations[0].contains("c-t-0-1 was in doubt"),
                "{violations:?}"
            );
        }
    }

    #[test]
    fn a_keyed_call_retried_after_an_unknown_outcome_is_not_in_doubt() {
        let start = Instant::now();
        let events = [unknown(1, "chaos.flaky", "c-t-0-0")];
        let events: Vec<&StoredEvent> = events.iter().collect();
        let mut violations = Vec::new();
        let in_doubt = check_model_waits_for_answers(
            &run_log(Vec::new()),
            &events,
            &[asked(0, start), asked(1, start)],
            &mut violations,
        );
        assert_eq!((in_doubt, violations), (0, Vec::<String>::new()));
    }

    fn execution(kind: ExecutionKind, tool: &str, key: &str, line: &str) -> Execution {
        Execution {
            kind,
            tool: tool.into(),
            key: key.into(),
            line: line.into(),
        }
    }

    #[test]
    fn mcp_calls_executed_once_and_keyed_retries_under_one_key_pass() {
        let executions = [
            execution(ExecutionKind::Exec, "hang", "run_a#1#0", "c-t-0-0"),
            execution(ExecutionKind::Exec, "drop", "run_a#1#1", "c-t-0-1"),
            execution(ExecutionKind::Exec, "flaky", "run_a#1#2", "c-t-0-2"),
            execution(ExecutionKind::Replay, "flaky", "run_a#1#2", "c-t-0-2"),
        ];
        let mut tally = Tally::default();
        let mut violations = Vec::new();
        check_mcp_executions(&executions, &mut tally, &mut violations);
        assert_eq!(violations, Vec::<String>::new());
        assert_eq!((tally.mcp_executions.len(), tally.keyed_replays), (3, 1));
    }

    #[test]
    fn a_never_call_executed_twice_or_a_keyed_call_under_two_keys_is_a_violation() {
        let cases = [
            (
                [
                    execution(ExecutionKind::Exec, "hang", "run_a#1#0", "c-t-0-0"),
                    execution(ExecutionKind::Exec, "hang", "run_a#1#0", "c-t-0-0"),
                ],
                "the never call c-t-0-0 (chaos.hang) was executed twice",
            ),
            (
                [
                    execution(ExecutionKind::Exec, "drop", "run_a#1#0", "c-t-0-0"),
                    execution(ExecutionKind::Exec, "drop", "run_a#1#0", "c-t-0-0"),
                ],
                "the never call c-t-0-0 (chaos.drop) was executed twice",
            ),
            (
                [
                    execution(ExecutionKind::Exec, "flaky", "run_a#1#0", "c-t-0-0"),
                    execution(ExecutionKind::Exec, "flaky", "run_a#2#0", "c-t-0-0"),
                ],
                "was sent under key run_a#1#0, then under run_a#2#0",
            ),
        ];
        for (executions, expected) in cases {
            let mut violations = Vec::new();
            check_mcp_executions(&executions, &mut Tally::default(), &mut violations);
            assert_eq!(violations.len(), 1, "{violations:?}");
            assert!(violations[0].contains(expected), "{violations:?}");
        }
    }

    #[test]
    fn an_effect_twice_or_from_nowhere_is_a_violation() {
        let workspace = tempfile::tempdir().unwrap();
        std::fs::create_dir(workspace.path().join(LOG_DIR)).unwrap();
        let file = workspace.path().join(LOG_DIR).join("t.log");
        std::fs::write(&file, "c-t-0-0\nc-t-0-1\n").unwrap();
        let mut tally = Tally::default();
        let mut violations = Vec::new();
        check_effects(workspace.path(), &mut tally, &mut violations).unwrap();
        assert_eq!((tally.appends, violations.len()), (2, 0));

        std::fs::write(&file, "c-t-0-0\nc-t-0-1\nc-t-0-0\nstray\n").unwrap();
        check_effects(workspace.path(), &mut tally, &mut violations).unwrap();
        assert_eq!(violations.len(), 2, "{violations:?}");
        assert!(violations.iter().all(|v| v.starts_with("invariant 5")));
    }

    #[test]
    fn a_started_call_told_it_was_not_run_is_a_violation_once() {
        let started = HashMap::from([("c-t-0-0".to_owned(), "ses_a".to_owned())]);
        let told = ["c-t-0-1".to_owned()];
        let mut tally = Tally::default();
        let mut violations = Vec::new();
        check_told_not_run(&told, &started, &mut tally, &mut violations);
        assert!(violations.is_empty(), "{violations:?}");
        let told = [
            "c-t-0-0".to_owned(),
            "c-t-0-0".to_owned(),
            "c-t-0-1".to_owned(),
        ];
        check_told_not_run(&told, &started, &mut tally, &mut violations);
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert!(violations[0].starts_with("invariant 24"), "{violations:?}");
        assert_eq!(tally.told_not_run, 4);
    }

    #[test]
    fn a_cancel_that_closed_a_batch_in_a_worker_process_is_counted_as_both() {
        let events = [
            stored(1, "a", "step.committed", json!({"worker": "host:41:x"})),
            stored(2, "a", "tool.result", json!({"content": "cancelled"})),
            stored(3, "a", "step.committed", json!({"worker": "host:42:y"})),
        ];
        let events: Vec<&StoredEvent> = events.iter().collect();
        let mut tally = Tally::default();
        count_cancel(&events, &[42], &mut tally);
        count_cancel(&events[..1], &[42], &mut tally);
        assert_eq!(
            (tally.cut_off_batches, tally.cancels_across_processes),
            (1, 1)
        );
    }
}
