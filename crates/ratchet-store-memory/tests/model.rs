//! The in-memory model and the SQL backends tell the same story. Random sequences of what the
//! Coordinator does — user messages (queued, refused, interrupting, steering), claims by two
//! workers, commits of the step results the engine would build (answers, tool batches, calls
//! written ahead, approvals, foreground and background delegations), stale and repeated
//! commits, heartbeats, retries, expired and released leases, crashes in the middle of a
//! step, cancels, pauses and resumes, human answers, continued failed runs, closed sessions,
//! overdue runs and inbox turns — are applied to the model and to a backend side by side.
//! After every operation both must have answered alike and everything `Reads` shows of them
//! must be equal; a disagreement is shrunk by proptest to a shortest sequence showing it.
//!
//! One test per backend (PostgreSQL only where `RATCHET_TEST_POSTGRES_URL` names a server),
//! and one proving that the comparison does fail when the two stores differ.

use std::cell::Cell;
use std::fmt::Debug;

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestError, TestRunner};
use ratchet_core::delegation::{
    BackgroundGroup, ChildRun, DELEGATE_TOOL, EMIT_SIGNAL_TOOL, await_children, background_started,
    delegate_tool, start_in_background,
};
use ratchet_core::inbox::{Severity, SignalContract, emit_signal_tool, parse_signal};
use ratchet_core::step::{
    Compaction, Reconciliation, Resumption, after_compaction, after_model, after_tools,
    ask_approval_step, await_reconciliation, finish_step,
};
use ratchet_core::{
    AgentProfile, ApprovalAnswer, ApprovalPolicy, BudgetExtension, CallDecision, CompletionPolicy,
    DelegationConfig, Delivery, EventDraft, EventKind, HumanRequest, InboxPolicy, Instruction,
    Limits, Lineage, MessageId, Millis, ModelReply, ReplayPolicy, Role, RunConfigSnapshot, RunId,
    SessionId, StepResult, StopReason, ToolCall, ToolOutcome, ToolSpec, UnknownCall, Usage,
    Verdict, decide,
};
use ratchet_postgres::testkit::TestDatabase;
use ratchet_store::{
    ClaimedStep, Closing, Commit, DEFAULT_TENANT, DeadLetterAction, Error, Intent, IntentKind,
    Lease, ListOrder, NewRun, NewSignal, RunQuota, SessionQuery, SessionSpec, SessionState,
    SignalOutcome, Store, StoredMessage, WhenBusy, Writes,
};
use ratchet_store_memory::MemoryStore;
use serde_json::{Value, json};

/// The clock of every case starts here and moves forward with each operation.
const T0: Millis = 1_000_000;
const LEASE_MS: Millis = 30_000;
/// How long a step given back for a retry waits before it may be claimed again.
const RETRY_MS: Millis = 2_000;
const WORKERS: [&str; 2] = ["worker-a", "worker-b"];
/// The root sessions every case starts with; messages go to one of them.
const SESSIONS: usize = 3;
const MAX_OPS: usize = 60;
/// Small enough that a run compacts its context after a few turns.
const MAX_PROMPT_TOKENS: u64 = 40;

/// One thing the Coordinator does, with the choices it leaves to the test.
#[derive(Debug, Clone)]
enum Op {
    Submit {
        session: usize,
        when_busy: WhenBusy,
        /// Admitted within a small per-session quota, rather than none.
        within_quota: bool,
    },
    /// A claim by `worker`, or by the other one when `worker` is busy; of one run's tree
    /// only, when `run` is given.
    Claim {
        worker: usize,
        run: Option<Index>,
    },
    /// The worker carries out its claimed step (claiming one first when it holds none) and
    /// commits the result.
    Commit {
        worker: usize,
        model: ModelTurn,
        tools_fail: bool,
        /// Asks to keep the run's next step under the worker's lease.
        keep_going: bool,
        /// The worker's process dies right after writing its first intent ahead.
        crash: bool,
    },
    /// A claim given up earlier (committed, lost, retried, released) commits again.
    CommitAgain {
        claim: Index,
    },
    /// The busy worker, `worker` first, extends its lease.
    Heartbeat {
        worker: usize,
    },
    /// The busy worker, `worker` first, streams part of its answer.
    Stream {
        worker: usize,
    },
    /// The busy worker, `worker` first, gives its step back to be retried a little later.
    RetryLater {
        worker: usize,
    },
    /// Time passes beyond every lease held so far.
    ExpireLeases,
    /// The worker's process died: recovery releases its leases, and its claim is never used.
    ReleaseLeases {
        worker: usize,
    },
    Cancel {
        run: Index,
    },
    Pause {
        run: Index,
    },
    Resume {
        run: Index,
    },
    ResumeFailed {
        run: Index,
        retry: bool,
    },
    Answer {
        approval: Index,
        answer: HumanAnswer,
    },
    /// A human says what happened to a call left in doubt.
    Reconcile {
        run: Index,
        answer: Reconciliation,
    },
    ServeInboxes,
    TimeOutOverdue,
    /// An operator requeues or discards an event of a session's inbox.
    ActOnInbox {
        session: usize,
        event: Index,
        discard: bool,
    },
    Close {
        session: usize,
        delete: bool,
    },
}

/// What the model answers when a step calls it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum ModelTurn {
    Text,
    Lookup,
    /// A batch in which one call needs a human's approval.
    Guarded,
    /// A call whose effect must not happen twice: it is written ahead.
    Charge,
    /// A signal to the root session (offered to background runs only).
    Signal,
    Delegate {
        tasks: usize,
        background: Option<CompletionPolicy>,
    },
    /// The call keeps failing: the run ends with `llm_error`.
    Fail,
}

#[derive(Debug, Clone, Copy)]
enum HumanAnswer {
    Approve,
    Deny,
    Abort,
}

fn op() -> impl Strategy<Value = Op> {
    let worker = 0..WORKERS.len();
    let when_busy = prop_oneof![
        3 => Just(WhenBusy::Enqueue),
        1 => Just(WhenBusy::Reject),
        1 => Just(WhenBusy::Interrupt),
        2 => Just(WhenBusy::Steer),
    ];
    let background = prop_oneof![
        2 => Just(None),
        1 => Just(Some(CompletionPolicy::All)),
        1 => Just(Some(CompletionPolicy::Each)),
    ];
    let model = prop_oneof![
        4 => Just(ModelTurn::Text),
        3 => Just(ModelTurn::Lookup),
        3 => Just(ModelTurn::Guarded),
        3 => Just(ModelTurn::Charge),
        2 => Just(ModelTurn::Signal),
        3 => (1..=2usize, background)
            .prop_map(|(tasks, background)| ModelTurn::Delegate { tasks, background }),
        1 => Just(ModelTurn::Fail),
    ];
    let answer = prop_oneof![
        Just(HumanAnswer::Approve),
        Just(HumanAnswer::Deny),
        Just(HumanAnswer::Abort),
    ];
    let reconciliation = prop_oneof![
        Just(Reconciliation::Succeeded),
        Just(Reconciliation::Failed),
        Just(Reconciliation::Retry),
        Just(Reconciliation::Skip),
    ];
    prop_oneof![
        8 => (0..SESSIONS, when_busy, prop::bool::weighted(0.1)).prop_map(
            |(session, when_busy, within_quota)| Op::Submit { session, when_busy, within_quota }
        ),
        5 => (worker.clone(), prop::option::weighted(0.3, any::<Index>()))
            .prop_map(|(worker, run)| Op::Claim { worker, run }),
        20 => (
            worker.clone(),
            model,
            prop::bool::weighted(0.2),
            any::<bool>(),
            prop::bool::weighted(0.3),
        )
            .prop_map(|(worker, model, tools_fail, keep_going, crash)| Op::Commit {
                worker,
                model,
                tools_fail,
                keep_going,
                crash,
            }),
        2 => any::<Index>().prop_map(|claim| Op::CommitAgain { claim }),
        1 => worker.clone().prop_map(|worker| Op::Heartbeat { worker }),
        1 => worker.clone().prop_map(|worker| Op::Stream { worker }),
        2 => worker.clone().prop_map(|worker| Op::RetryLater { worker }),
        4 => Just(Op::ExpireLeases),
        1 => worker.prop_map(|worker| Op::ReleaseLeases { worker }),
        2 => any::<Index>().prop_map(|run| Op::Cancel { run }),
        2 => any::<Index>().prop_map(|run| Op::Pause { run }),
        2 => any::<Index>().prop_map(|run| Op::Resume { run }),
        2 => (any::<Index>(), any::<bool>())
            .prop_map(|(run, retry)| Op::ResumeFailed { run, retry }),
        5 => (any::<Index>(), answer)
            .prop_map(|(approval, answer)| Op::Answer { approval, answer }),
        3 => (any::<Index>(), reconciliation)
            .prop_map(|(run, answer)| Op::Reconcile { run, answer }),
        3 => Just(Op::ServeInboxes),
        1 => Just(Op::TimeOutOverdue),
        2 => (0..SESSIONS, any::<Index>(), any::<bool>())
            .prop_map(|(session, event, discard)| Op::ActOnInbox { session, event, discard }),
        1 => (0..SESSIONS, prop::bool::weighted(0.3))
            .prop_map(|(session, delete)| Op::Close { session, delete }),
    ]
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(), 1..=MAX_OPS)
}

fn tool(name: &str, approval: ApprovalPolicy, replay: ReplayPolicy) -> ToolSpec {
    ToolSpec {
        name: name.into(),
        description: String::new(),
        parameters: json!({"type": "object"}),
        replay,
        completes_run: false,
        approval,
        delegation: Default::default(),
        calls: Default::default(),
    }
}

/// The tools and limits of every run: one tool gated, one written ahead; few steps, a short
/// deadline and a small prompt, so that longer runs meet their budget, waiting ones time out
/// and contexts are compacted.
fn base_config() -> RunConfigSnapshot {
    RunConfigSnapshot {
        model: "scripted:model-test".into(),
        tools: vec![
            tool("lookup", ApprovalPolicy::Never, ReplayPolicy::Safe),
            tool("guarded", ApprovalPolicy::Always, ReplayPolicy::Safe),
            tool("charge", ApprovalPolicy::Never, ReplayPolicy::Never),
        ],
        limits: Limits {
            max_steps: 8,
            max_duration_ms: Some(3 * LEASE_MS as u64),
            max_prompt_tokens: Some(MAX_PROMPT_TOKENS),
            ..Limits::default()
        },
        ..RunConfigSnapshot::default()
    }
}

/// An agent a user's run may delegate to; in the background, it may signal the root session
/// (queued for a continuation turn, or steered into the active run).
fn agent(id: &str, delivery: Delivery) -> AgentProfile {
    AgentProfile {
        id: id.into(),
        description: format!("{id}s do the work"),
        config: RunConfigSnapshot {
            signal: Some(SignalContract {
                max_count: 3,
                min_interval_ms: 0,
                max_bytes: 1_000,
                severities: vec![Severity::Info],
                dedupe_window_ms: 5_000,
                delivery,
                max_burst: 2,
                max_depth: 4,
            }),
            ..base_config()
        },
    }
}

/// A user's run: delegation to agents in a small tree, with a small inbox whose reports are
/// retried and expire quickly.
fn user_config() -> RunConfigSnapshot {
    let agents = vec![
        agent("worker", Delivery::Queue),
        agent("scout", Delivery::Steer),
    ];
    let mut config = base_config();
    config.tools.push(delegate_tool(&agents));
    config.delegation = DelegationConfig {
        agents,
        max_depth: 2,
        max_tree_runs: 6,
        inbox: InboxPolicy {
            capacity: 3,
            max_attempts: 2,
            retry_backoff_ms: 1_000,
            user_turns_before_inbox: 1,
            max_wait_ms: 10_000,
            max_age_ms: 2 * LEASE_MS as u64,
            ..InboxPolicy::default()
        },
        ..DelegationConfig::default()
    };
    config
}

fn model_reply(turn: ModelTurn) -> ModelReply {
    let call = |id: &str, name: &str, arguments: Value| ToolCall {
        id: id.into(),
        name: name.into(),
        arguments,
    };
    let (text, tool_calls) = match turn {
        ModelTurn::Text | ModelTurn::Fail => ("the answer is 42", vec![]),
        ModelTurn::Lookup => (
            "let me look",
            vec![call("call-1", "lookup", json!({"q": "answer"}))],
        ),
        ModelTurn::Guarded => (
            "this needs a yes",
            vec![
                call("call-1", "lookup", json!({"q": "answer"})),
                call("call-2", "guarded", json!({"act": "now"})),
            ],
        ),
        ModelTurn::Charge => (
            "paying",
            vec![
                call("call-1", "charge", json!({"cents": 100})),
                call("call-2", "lookup", json!({"q": "receipt"})),
            ],
        ),
        ModelTurn::Signal => (
            "telling the user",
            vec![call(
                "call-1",
                EMIT_SIGNAL_TOOL,
                json!({"severity": "info", "summary": "halfway there"}),
            )],
        ),
        ModelTurn::Delegate { tasks, background } => {
            let tasks: Vec<Value> = (0..tasks)
                .map(|i| {
                    let agent = ["worker", "scout"][i % 2];
                    json!({"agent": agent, "task": format!("task {i}")})
                })
                .collect();
            let arguments = match background {
                None => json!({"mode": "foreground", "tasks": tasks}),
                Some(policy) => json!({
                    "mode": "background",
                    "completion_policy": policy.as_str(),
                    "tasks": tasks,
                }),
            };
            (
                "handing out",
                vec![call("call-1", DELEGATE_TOOL, arguments)],
            )
        }
    };
    ModelReply {
        text: text.into(),
        tool_calls,
        usage: unmeasured_prompt(),
        reasoning: String::new(),
    }
}

/// A model that does not report the size of its prompt: the run estimates it from its
/// messages, so that longer runs come to compact their context.
fn unmeasured_prompt() -> Usage {
    Usage {
        input_tokens: 0,
        output_tokens: 5,
        reasoning_tokens: 0,
        cache_write_tokens: 0,
        cache_read_tokens: 0,
    }
}

fn lease(worker: usize, expires_at: Millis) -> Lease {
    Lease {
        owner: WORKERS[worker].to_owned(),
        expires_at,
    }
}

/// A call's answer as compared: the whole value, or only the error's variant (its text is
/// each backend's own wording).
fn outcome<T: Debug>(result: &ratchet_store::Result<T>) -> String {
    match result {
        Ok(value) => format!("{value:#?}"),
        Err(error) => format!("error: {}", error_variant(error)),
    }
}

fn error_variant(error: &Error) -> String {
    match error {
        Error::NotFound { kind, .. } => format!("NotFound({kind})"),
        Error::Conflict(_) => "Conflict".into(),
        Error::Invalid(_) => "Invalid".into(),
        Error::LeaseLost { run_id, step_index } => format!("LeaseLost({run_id}#{step_index})"),
        Error::CancelRequested { run_id } => format!("CancelRequested({run_id})"),
        Error::QuotaExceeded(_) => "QuotaExceeded".into(),
        Error::SteerQueueFull(_) => "SteerQueueFull".into(),
        Error::BadUrl { .. } => "BadUrl".into(),
        Error::Corrupt(_) => "Corrupt".into(),
        Error::Backend(_) => "Backend".into(),
        Error::Secrets(_) => "Secrets".into(),
    }
}

/// Where two renderings first part, with a little of what surrounds it.
fn difference(expected: &str, found: &str) -> String {
    let expected: Vec<&str> = expected.lines().collect();
    let found: Vec<&str> = found.lines().collect();
    let at = (expected.iter().zip(&found))
        .position(|(e, f)| e != f)
        .unwrap_or(expected.len().min(found.len()));
    let around = |lines: &[&str]| lines[at.saturating_sub(6)..(at + 4).min(lines.len())].join("\n");
    format!(
        "at line {}:\n--- model ---\n{}\n--- backend ---\n{}",
        at + 1,
        around(&expected),
        around(&found)
    )
}

fn agree<T: Debug>(
    call: &str,
    expected: &ratchet_store::Result<T>,
    found: &ratchet_store::Result<T>,
) -> Result<(), Mismatch> {
    let (expected, found) = (outcome(expected), outcome(found));
    if expected == found {
        Ok(())
    } else {
        Err(format!(
            "{call} answered differently {}",
            difference(&expected, &found)
        ))
    }
}

/// A store's runs in id order (neither backend promises an order for `list_runs`).
async fn runs_by_id(store: &dyn Store) -> ratchet_store::Result<Vec<ratchet_store::RunSummary>> {
    let mut runs = store.list_runs().await?;
    runs.sort_by(|a, b| a.run_id.cmp(&b.run_id));
    Ok(runs)
}

/// Everything a reader can see of a store, section by section; with `deep`, also what each
/// step showed the model and wrote, and the intents of every step.
async fn snapshot(
    store: &dyn Store,
    roots: &[SessionId],
    now: Millis,
    deep: bool,
) -> Vec<(String, String)> {
    let mut sections = Vec::new();
    let runs = runs_by_id(store).await;
    // Neither backend promises an order for these lists.
    let mut runs_with_jobs = store.runs_with_jobs().await;
    if let Ok(runs) = &mut runs_with_jobs {
        runs.sort();
    }
    let mut lease_owners = store.lease_owners().await;
    if let Ok(owners) = &mut lease_owners {
        owners.sort();
    }
    let mut stats = store.stats(now).await;
    if let Ok(stats) = &mut stats {
        (stats.runs_by_status).sort_by_key(|(status, _)| status.as_str());
    }
    let mut sessions: Vec<SessionId> = roots.to_vec();
    for run in runs.iter().flatten() {
        if !sessions.contains(&run.session_id) {
            sessions.push(run.session_id.clone());
        }
    }
    sections.push(("list_runs".into(), outcome(&runs)));
    sections.push(("runs_with_jobs".into(), outcome(&runs_with_jobs)));
    sections.push(("lease_owners".into(), outcome(&lease_owners)));
    sections.push(("stats".into(), outcome(&stats)));
    let listed = store
        .list_sessions(DEFAULT_TENANT, &SessionQuery::default(), 1_000)
        .await;
    sections.push(("list_sessions".into(), outcome(&listed)));
    for state in [
        SessionState::WaitingHuman,
        SessionState::Active,
        SessionState::Failed,
        SessionState::Idle,
        SessionState::Archived,
    ] {
        let query = SessionQuery {
            order: ListOrder::LatestActivityFirst,
            state: Some(state),
            ..SessionQuery::default()
        };
        let listed = store.list_sessions(DEFAULT_TENANT, &query, 1_000).await;
        sections.push((format!("list_sessions {state:?}"), outcome(&listed)));
    }
    let approvals = store.approvals(DEFAULT_TENANT, None, None, 1_000).await;
    sections.push(("approvals".into(), outcome(&approvals)));
    for session in &sessions {
        let mut section = |call: &str, shown: String| {
            sections.push((format!("{call} {session}"), shown));
        };
        section("get_session", outcome(&store.get_session(session).await));
        section(
            "events_after",
            outcome(&store.events_after(session, 0, 10_000).await),
        );
        section(
            "events_within 1 KiB",
            outcome(&store.events_within(session, 0, 10_000, 1_024).await),
        );
        section(
            "visible_messages",
            outcome(&store.visible_messages(session, 0, 10_000).await),
        );
        section("history", outcome(&store.history(session).await));
        section(
            "session_runs",
            outcome(&store.session_runs(session, None, 1_000).await),
        );
        section(
            "pending_input",
            outcome(&store.pending_input(session, now).await),
        );
        section(
            "inbox",
            outcome(&store.inbox(session, None, 0, 1_000).await),
        );
    }
    for run in runs.iter().flatten() {
        let id = &run.run_id;
        let mut section = |call: &str, shown: String| {
            sections.push((format!("{call} {id}"), shown));
        };
        section("load_state", outcome(&store.load_state(id).await));
        section("steps", outcome(&store.steps(id).await));
        section(
            "run_events_after",
            outcome(&store.run_events_after(id, 0, 10_000).await),
        );
        section(
            "context",
            outcome(&store.context(&run.session_id, id).await),
        );
        section("run_tree", outcome(&store.run_tree(id).await));
        // The step in flight, if any, is the one after the committed one.
        section(
            "intents in flight",
            outcome(&store.intents(id, run.step_index + 1).await),
        );
        if deep {
            section("tree_spend", outcome(&store.tree_spend(id).await));
            section("admission", outcome(&store.admission(id).await));
            for step in 1..=run.step_index {
                section(
                    &format!("step_messages #{step}"),
                    outcome(&store.step_messages(id, step).await),
                );
                section(
                    &format!("intents #{step}"),
                    outcome(&store.intents(id, step).await),
                );
            }
        }
    }
    sections
}

/// Ids the test chooses, the same for both stores, from a counter.
#[derive(Default)]
struct Names {
    next: u64,
}

impl Names {
    fn fresh(&mut self) -> String {
        self.next += 1;
        format!("case-{}", self.next)
    }
}

/// What a case has done, for the report of the whole test.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    commits: usize,
    stale_commits: usize,
    children: usize,
    approvals_answered: usize,
    reconciled: usize,
    continuations: usize,
    compactions: usize,
    signals: usize,
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.commits += other.commits;
        self.stale_commits += other.stale_commits;
        self.children += other.children;
        self.approvals_answered += other.approvals_answered;
        self.reconciled += other.reconciled;
        self.continuations += other.continuations;
        self.compactions += other.compactions;
        self.signals += other.signals;
    }
}

type Mismatch = String;

/// One case: the model and a backend, and what the test knows of them. Everything handed to
/// a store is derived from this, or from the model's answers once the backend's agreed.
struct Harness<'a> {
    model: &'a dyn Store,
    backend: &'a dyn Store,
    names: Names,
    now: Millis,
    sessions: Vec<SessionId>,
    held: [Option<ClaimedStep>; 2],
    /// Claims their workers no longer use, for committing again.
    earlier: Vec<ClaimedStep>,
    tally: Tally,
}

impl<'a> Harness<'a> {
    fn new(model: &'a dyn Store, backend: &'a dyn Store) -> Harness<'a> {
        Harness {
            model,
            backend,
            names: Names::default(),
            now: T0,
            sessions: Vec::new(),
            held: [None, None],
            earlier: Vec::new(),
            tally: Tally::default(),
        }
    }

    /// Makes the same call on both stores; their answers must agree.
    async fn both<T: Debug>(
        &self,
        call: &str,
        make: impl AsyncFn(&dyn Store) -> ratchet_store::Result<T>,
    ) -> Result<ratchet_store::Result<T>, Mismatch> {
        let expected = make(self.model).await;
        let found = make(self.backend).await;
        agree(call, &expected, &found)?;
        Ok(expected)
    }

    /// `both`, for a call whose answer only has to agree.
    async fn same<T: Debug>(
        &self,
        call: &str,
        make: impl AsyncFn(&dyn Store) -> ratchet_store::Result<T>,
    ) -> Result<(), Mismatch> {
        self.both(call, make).await.map(drop)
    }

    async fn compare_snapshots(&self, deep: bool) -> Result<(), Mismatch> {
        let expected = snapshot(self.model, &self.sessions, self.now, deep).await;
        let found = snapshot(self.backend, &self.sessions, self.now, deep).await;
        for at in 0..expected.len().max(found.len()) {
            match (expected.get(at), found.get(at)) {
                (Some((name, e)), Some((other, f))) if name == other => {
                    if e != f {
                        return Err(format!("{name} differs {}", difference(e, f)));
                    }
                }
                (e, f) => {
                    let name = |section: Option<&(String, String)>| section.map(|(n, _)| n.clone());
                    return Err(format!(
                        "the model shows {:?} where the backend shows {:?}",
                        name(e),
                        name(f)
                    ));
                }
            }
        }
        Ok(())
    }

    async fn start(&mut self) -> Result<(), Mismatch> {
        for _ in 0..SESSIONS {
            let id = SessionId::from_suffix(&self.names.fresh()).unwrap();
            let now = self.now;
            self.same("create_session", async |s| {
                s.create_session(&id, SessionSpec::default(), now).await
            })
            .await?;
            self.sessions.push(id);
        }
        self.compare_snapshots(false).await
    }

    async fn apply(&mut self, op: &Op) -> Result<(), Mismatch> {
        // Each operation happens at an instant of its own.
        self.now += 1;
        let now = self.now;
        match *op {
            Op::Submit {
                session,
                when_busy,
                within_quota,
            } => {
                let suffix = self.names.fresh();
                let new = NewRun {
                    session_id: self.sessions[session].clone(),
                    run_id: RunId::from_suffix(&suffix).unwrap(),
                    message_id: MessageId::from_suffix(&suffix).unwrap(),
                    content: format!("question {suffix}"),
                    config: user_config(),
                    when_busy,
                    quota: RunQuota {
                        per_session: within_quota.then_some(3),
                        global: None,
                    },
                    trace: None,
                    request: None,
                };
                self.same("submit_message", async |s| {
                    s.submit_message(new.clone(), now).await
                })
                .await?;
            }
            Op::Claim { worker, run } => {
                let Some(worker) = self.idle_worker(worker) else {
                    return Ok(());
                };
                let scope = match run {
                    Some(run) => match self.pick_run(run).await? {
                        Some(run) => Some(run),
                        None => return Ok(()),
                    },
                    None => None,
                };
                self.claim(worker, scope).await?;
            }
            Op::Commit {
                worker,
                model,
                tools_fail,
                keep_going,
                crash,
            } => {
                (self.commit(worker, model, tools_fail, keep_going, crash)).await?;
            }
            Op::CommitAgain { claim } => self.commit_again(claim).await?,
            Op::Heartbeat { worker } => {
                let Some(worker) = self.busy_worker(worker) else {
                    return Ok(());
                };
                let claim = &self.held[worker].as_ref().expect("a busy worker").claim;
                self.same("heartbeat", async |s| {
                    s.heartbeat(claim, now + LEASE_MS).await
                })
                .await?;
            }
            Op::Stream { worker } => self.stream(worker).await?,
            Op::RetryLater { worker } => self.retry_later(worker).await?,
            Op::ExpireLeases => {
                self.now += LEASE_MS;
            }
            Op::ReleaseLeases { worker } => {
                self.same("release_leases", async |s| {
                    s.release_leases(WORKERS[worker]).await
                })
                .await?;
                self.earlier.extend(self.held[worker].take());
            }
            Op::Cancel { run } => {
                let Some(run) = self.pick_run(run).await? else {
                    return Ok(());
                };
                self.same("request_cancel", async |s| {
                    s.request_cancel(&run, now).await
                })
                .await?;
            }
            Op::Pause { run } => {
                let Some(run) = self.pick_run(run).await? else {
                    return Ok(());
                };
                self.same("request_pause", async |s| s.request_pause(&run, now).await)
                    .await?;
            }
            Op::Resume { run } => {
                let Some(run) = self.pick_run(run).await? else {
                    return Ok(());
                };
                self.same("resume_paused", async |s| s.resume_paused(&run, now).await)
                    .await?;
            }
            Op::ResumeFailed { run, retry } => {
                let Some(run) = self.pick_run(run).await? else {
                    return Ok(());
                };
                let how = if retry {
                    Resumption::Retry
                } else {
                    Resumption::Continue {
                        extension: BudgetExtension {
                            steps: 4,
                            duration_ms: LEASE_MS as u64,
                            ..BudgetExtension::default()
                        },
                    }
                };
                self.same("resume_failed", async |s| {
                    s.resume_failed(&run, how, None, now).await
                })
                .await?;
            }
            Op::Answer { approval, answer } => self.answer_approval(approval, answer).await?,
            Op::Reconcile { run, answer } => self.reconcile(run, answer).await?,
            Op::ServeInboxes => {
                self.same("serve_inboxes", async |s| s.serve_inboxes(now).await)
                    .await?;
            }
            Op::TimeOutOverdue => {
                self.same("time_out_overdue", async |s| s.time_out_overdue(now).await)
                    .await?;
            }
            Op::ActOnInbox {
                session,
                event,
                discard,
            } => self.act_on_inbox(session, event, discard).await?,
            Op::Close { session, delete } => {
                let session = self.sessions[session].clone();
                let how = if delete {
                    Closing::Delete
                } else {
                    Closing::Archive
                };
                self.same("close_session", async |s| {
                    s.close_session(&session, how, now).await
                })
                .await?;
            }
        }
        Ok(())
    }

    /// The worker carries out its claimed step, claiming one first when it holds none, and
    /// commits what it did (nothing, when it gave the step up on the way).
    async fn commit(
        &mut self,
        worker: usize,
        model: ModelTurn,
        tools_fail: bool,
        keep_going: bool,
        crash: bool,
    ) -> Result<(), Mismatch> {
        let now = self.now;
        if self.held[worker].is_none() {
            self.claim(worker, None).await?;
        }
        let Some(claimed) = self.held[worker].take() else {
            return Ok(());
        };
        let carried_out = self.carry_out(&claimed, model, tools_fail, crash).await?;
        if let Some(result) = carried_out {
            let children = result.children.len();
            let continue_with = keep_going.then(|| lease(worker, now + LEASE_MS));
            let commit = self
                .both("commit_step", async |s| {
                    (s.commit_step(&claimed.claim, result.clone(), continue_with.clone(), now))
                        .await
                })
                .await?;
            match commit {
                Ok(Commit::Committed { continued, .. }) => {
                    self.tally.commits += 1;
                    self.tally.children += children;
                    self.tally.continuations += usize::from(claimed.state.config.continuation);
                    self.tally.compactions +=
                        usize::from(result.record.instruction == "compress_context");
                    self.held[worker] = continued;
                }
                Ok(Commit::Stale(_)) => self.tally.stale_commits += 1,
                Err(_) => {}
            }
        }
        self.earlier.push(claimed);
        Ok(())
    }

    /// A claim given up earlier commits a step again: refused as stale, unless nobody has
    /// claimed its job since.
    async fn commit_again(&mut self, claim: Index) -> Result<(), Mismatch> {
        let now = self.now;
        if self.earlier.is_empty() {
            return Ok(());
        }
        let claimed = claim.get(&self.earlier).clone();
        let carried_out = (self.carry_out(&claimed, ModelTurn::Text, false, false)).await?;
        let Some(result) = carried_out else {
            return Ok(());
        };
        let commit = self
            .both("commit_step (again)", async |s| {
                s.commit_step(&claimed.claim, result.clone(), None, now)
                    .await
            })
            .await?;
        match commit {
            Ok(Commit::Committed { .. }) => self.tally.commits += 1,
            Ok(Commit::Stale(_)) => self.tally.stale_commits += 1,
            Err(_) => {}
        }
        Ok(())
    }

    /// The busy worker streams part of the model's answer, as deltas outside the commit.
    async fn stream(&self, worker: usize) -> Result<(), Mismatch> {
        let Some(worker) = self.busy_worker(worker) else {
            return Ok(());
        };
        let state = &self.held[worker].as_ref().expect("a busy worker").state;
        let delta = EventDraft::new(
            EventKind::AssistantDelta,
            json!({"run_id": state.run_id, "text": "the answer"}),
        );
        self.same("append_events", async |s| {
            (s.append_events(
                &state.session_id,
                &state.run_id,
                vec![delta.clone()],
                self.now,
            ))
            .await
        })
        .await
    }

    /// The busy worker gives its step back after a failed attempt, to be retried shortly.
    async fn retry_later(&mut self, worker: usize) -> Result<(), Mismatch> {
        let now = self.now;
        let Some(worker) = self.busy_worker(worker) else {
            return Ok(());
        };
        let claimed = self.held[worker].take().expect("a busy worker");
        let event = EventDraft::new(
            EventKind::Activity,
            json!({
                "run_id": claimed.job.run_id,
                "activity": "step_released",
                "step_index": claimed.job.step_index,
                "attempt": claimed.job.attempt,
                "error": "the model is overloaded",
            }),
        );
        self.same("retry_later", async |s| {
            (s.retry_later(&claimed.claim, now + RETRY_MS, event.clone(), now)).await
        })
        .await?;
        self.earlier.push(claimed);
        Ok(())
    }

    /// An operator requeues or discards one of a session's inbox events (only a dead
    /// letter may be, alike on both sides).
    async fn act_on_inbox(
        &self,
        session: usize,
        event: Index,
        discard: bool,
    ) -> Result<(), Mismatch> {
        let session = &self.sessions[session];
        let events = (self.model.inbox(session, None, 0, 1_000))
            .await
            .map_err(|e| format!("the model cannot list the inbox of {session}: {e}"))?;
        if events.is_empty() {
            return Ok(());
        }
        let event_id = event.get(&events).id;
        let action = if discard {
            DeadLetterAction::Discard
        } else {
            DeadLetterAction::Requeue
        };
        self.same("act_on_dead_letter", async |s| {
            (s.act_on_dead_letter(session, event_id, action, "an operator", self.now)).await
        })
        .await
    }

    /// The idle `worker` claims the next job (of `scope`'s tree only, when given), if any.
    async fn claim(&mut self, worker: usize, scope: Option<RunId>) -> Result<(), Mismatch> {
        let now = self.now;
        let lease = lease(worker, now + LEASE_MS);
        let expected = (self.model)
            .claim_next(lease.clone(), scope.as_ref(), now)
            .await;
        // Among jobs due at the same instant the order is not part of the contract (SQL
        // orders by `ready_at` alone): the backend is asked for the model's pick.
        let picked = match &expected {
            Ok(Some(claimed)) => Some(claimed.job.run_id.clone()),
            _ => scope,
        };
        let found = self.backend.claim_next(lease, picked.as_ref(), now).await;
        agree("claim_next", &expected, &found)?;
        if let Ok(Some(claimed)) = expected {
            self.held[worker] = Some(claimed);
        }
        Ok(())
    }

    /// `worker` if it holds no claim (a worker runs one step at a time), else the other one
    /// if it holds none.
    fn idle_worker(&self, worker: usize) -> Option<usize> {
        [worker, 1 - worker]
            .into_iter()
            .find(|&w| self.held[w].is_none())
    }

    /// `worker` if it holds a claim, else the other one if it holds one.
    fn busy_worker(&self, worker: usize) -> Option<usize> {
        [worker, 1 - worker]
            .into_iter()
            .find(|&w| self.held[w].is_some())
    }

    /// One of the model's runs (the backend lists the same ones: the last snapshot said so).
    async fn pick_run(&self, index: Index) -> Result<Option<RunId>, Mismatch> {
        let runs = runs_by_id(self.model)
            .await
            .map_err(|e| format!("the model cannot list its runs: {e}"))?;
        Ok((!runs.is_empty()).then(|| index.get(&runs).run_id.clone()))
    }

    async fn answer_approval(
        &mut self,
        approval: Index,
        answer: HumanAnswer,
    ) -> Result<(), Mismatch> {
        let now = self.now;
        let approvals = (self.model.approvals(DEFAULT_TENANT, None, None, 1_000))
            .await
            .map_err(|e| format!("the model cannot list its approvals: {e}"))?;
        if approvals.is_empty() {
            return Ok(());
        }
        let approval = approval.get(&approvals);
        let verdict = |needs_approval: bool| match answer {
            HumanAnswer::Deny if needs_approval => Verdict::Deny,
            _ => Verdict::Approve,
        };
        let answer = match answer {
            HumanAnswer::Abort => ApprovalAnswer::Abort,
            HumanAnswer::Approve | HumanAnswer::Deny => ApprovalAnswer::Decisions(
                (approval.calls.iter())
                    .map(|call| CallDecision {
                        call_id: call.call_id.clone(),
                        decision: verdict(call.needs_approval),
                        note: None,
                    })
                    .collect(),
            ),
        };
        let answered = self
            .both("answer_approval", async |s| {
                s.answer_approval(&approval.id, answer.clone(), "a human", now)
                    .await
            })
            .await?;
        self.tally.approvals_answered += usize::from(answered.is_ok());
        Ok(())
    }

    /// Answers the first call a run waits on a human for, or the first one it left in doubt
    /// when it ended: of such a run when there is one (any other run is refused, alike on
    /// both sides).
    async fn reconcile(&mut self, run: Index, answer: Reconciliation) -> Result<(), Mismatch> {
        let now = self.now;
        let runs = runs_by_id(self.model)
            .await
            .map_err(|e| format!("the model cannot list its runs: {e}"))?;
        let mut asked = Vec::new();
        let mut others = Vec::new();
        for summary in runs {
            let state = (self.model.load_state(&summary.run_id))
                .await
                .map_err(|e| format!("the model cannot load {}: {e}", summary.run_id))?;
            let call = match &state.pending_human {
                Some(HumanRequest::Reconciliation { calls }) => calls.first(),
                _ => state.in_doubt.first(),
            };
            match call {
                Some(call) => asked.push((summary.run_id, call.call_id.clone())),
                None => others.push((summary.run_id, "call-1".to_owned())),
            }
        }
        let candidates = if asked.is_empty() { others } else { asked };
        if candidates.is_empty() {
            return Ok(());
        }
        let (run, call_id) = run.get(&candidates);
        let reconciled = self
            .both("reconcile", async |s| {
                s.reconcile(run, call_id, answer, Some("done".into()), now)
                    .await
            })
            .await?;
        self.tally.reconciled += usize::from(reconciled.is_ok());
        Ok(())
    }

    /// What the engine would commit for `claimed`: the Brain's instruction for its step,
    /// carried out with the model answering `model` and tools succeeding unless `tools_fail`.
    /// None when the worker gave the step up on the way (a write ahead was refused, or its
    /// process died).
    async fn carry_out(
        &mut self,
        claimed: &ClaimedStep,
        model: ModelTurn,
        tools_fail: bool,
        crash: bool,
    ) -> Result<Option<StepResult>, Mismatch> {
        let (state, job, now) = (claimed.state.clone(), &claimed.job, self.now);
        Ok(Some(match decide(&state, job.phase, now) {
            Instruction::Finish(reason) => finish_step(state, job, reason, now, now),
            Instruction::AskApproval => ask_approval_step(state, job, now, now),
            Instruction::CompressContext => return self.compact(claimed).await,
            Instruction::CallLlm { .. } if model == ModelTurn::Fail => {
                finish_step(state, job, StopReason::LlmError, now, now)
            }
            Instruction::CallLlm { conclude } => {
                after_model(state, job, model_reply(model), conclude, now, now)
            }
            Instruction::CallToolsBatch => {
                return self.run_batch(claimed, tools_fail, crash).await;
            }
        }))
    }

    /// The context is summarised as the engine does it: the model's summary takes the place
    /// of the oldest messages, keeping the latest ones that fit half the prompt budget (and no
    /// tool result without its call). None when the context cannot be read.
    async fn compact(&self, claimed: &ClaimedStep) -> Result<Option<StepResult>, Mismatch> {
        let (state, job, now) = (&claimed.state, &claimed.job, self.now);
        let read = self
            .both("context", async |s| {
                s.context(&state.session_id, &state.run_id).await
            })
            .await?;
        let Ok(context) = read else {
            return Ok(None);
        };
        let budget = state.limits().max_prompt_tokens.unwrap_or(u64::MAX) / 2;
        let cut = compaction_cut(&context, budget);
        let compaction = (cut > 0).then(|| Compaction {
            reply: ModelReply {
                text: format!("a summary of {cut} messages"),
                tool_calls: Vec::new(),
                usage: unmeasured_prompt(),
                reasoning: String::new(),
            },
            keeps_from: context
                .get(cut)
                .map_or_else(|| context[cut - 1].position + 1, |m| m.position),
            summarized: cut,
            kept_tokens: (context[cut..].iter())
                .map(|m| m.message.estimated_tokens())
                .sum(),
        });
        Ok(Some(after_compaction(
            state.clone(),
            job,
            compaction,
            now,
            now,
        )))
    }

    /// The batch of the claimed step, as the engine runs it: outcomes known before (in the
    /// checkpoint, or recorded by an earlier attempt) are kept; a call written ahead by an
    /// earlier attempt without an outcome is in doubt, and a human is asked before anything
    /// runs; a call of a tool the run was not offered is invalid; a delegation that fits the
    /// tree and the inbox starts its children; the other calls run in order, a `never` one
    /// written ahead.
    async fn run_batch(
        &mut self,
        claimed: &ClaimedStep,
        tools_fail: bool,
        crash: bool,
    ) -> Result<Option<StepResult>, Mismatch> {
        let (state, job, now) = (&claimed.state, &claimed.job, self.now);
        let calls = (state.checkpoint.as_ref())
            .map(|c| c.calls.clone())
            .unwrap_or_default();
        let earlier = if job.attempt > 1 {
            let (run, step) = (job.run_id.clone(), job.step_index);
            (self.both("intents", async |s| s.intents(&run, step).await))
                .await?
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        let mut outcomes = Vec::new();
        let mut invalid = 0;
        let mut in_doubt = Vec::new();
        let mut to_run = Vec::new();
        let mut delegated = None;
        for (slot, progress) in (0u32..).zip(&calls) {
            let call = &progress.call;
            let started_before = earlier.iter().find(|intent| intent.slot == slot);
            let known = (progress.outcome.clone())
                .or_else(|| started_before.and_then(|intent| intent.outcome.clone()));
            let never = (state.config.tool(&call.name))
                .is_some_and(|spec| spec.replay == ReplayPolicy::Never);
            if known.is_none() && started_before.is_some() && never {
                in_doubt.push(UnknownCall {
                    call_index: slot as usize,
                    call_id: call.id.clone(),
                    tool: call.name.clone(),
                    arguments: call.arguments.clone(),
                    idempotency_key: call_key(claimed, slot),
                    drift: None,
                });
            } else if known.is_none() && state.config.tool(&call.name).is_none() {
                invalid += 1;
                outcomes.push(Some(ToolOutcome::error(format!(
                    "there is no tool {:?}",
                    call.name
                ))));
                continue;
            } else if known.is_none() && call.name == DELEGATE_TOOL {
                delegated = Some((slot, call.clone()));
            } else if known.is_none() {
                to_run.push((slot, call.clone()));
            }
            outcomes.push(known);
        }
        if !in_doubt.is_empty() {
            let request = HumanRequest::Reconciliation { calls: in_doubt };
            let result = await_reconciliation(state.clone(), job, outcomes, request, now, now);
            return Ok(Some(result));
        }
        let delegated = match delegated {
            Some((slot, call)) => match self.admit(claimed, &call).await? {
                Ok(()) => Some((slot, call)),
                Err(refusal) => {
                    outcomes[slot as usize] = Some(ToolOutcome::error(refusal));
                    None
                }
            },
            None => None,
        };
        // What a call that runs says as it starts; a call written ahead says it with its intent.
        let mut call_events = Vec::new();
        for (slot, call) in to_run {
            let announce = EventDraft::new(
                EventKind::ToolCall,
                json!({
                    "run_id": job.run_id,
                    "step_index": job.step_index,
                    "call_id": call.id,
                    "tool": call.name,
                    "arguments": call.arguments,
                    "attempt": 1,
                    "started_at": now,
                }),
            );
            let outcome = match state.config.tool(&call.name).map(|spec| spec.replay) {
                Some(ReplayPolicy::Never) => {
                    let Some(outcome) = self
                        .write_ahead(claimed, slot, &call, announce, tools_fail, crash)
                        .await?
                    else {
                        return Ok(None);
                    };
                    outcome
                }
                _ if call.name == EMIT_SIGNAL_TOOL => {
                    call_events.push(announce);
                    self.emit_signal(claimed, slot, &call).await?
                }
                _ => {
                    call_events.push(announce);
                    ran(tools_fail, "found it")
                }
            };
            outcomes[slot as usize] = Some(outcome);
        }
        let mut result = match delegated {
            None => {
                let outcomes = outcomes.into_iter().flatten().collect();
                after_tools(state.clone(), job, outcomes, invalid, now, now)
            }
            Some((slot, call)) => {
                let background = (call.arguments["mode"] == "background").then(|| {
                    match call.arguments["completion_policy"].as_str() {
                        Some("each") => CompletionPolicy::Each,
                        _ => CompletionPolicy::All,
                    }
                });
                let children = self.children(claimed, slot, &call, background);
                match background {
                    None => await_children(state.clone(), job, outcomes, children, now, now),
                    Some(policy) => {
                        let started: Vec<&ChildRun> = children.iter().collect();
                        outcomes[slot as usize] = Some(background_started(&started, policy));
                        let outcomes = outcomes.into_iter().flatten().collect();
                        let mut result =
                            after_tools(state.clone(), job, outcomes, invalid, now, now);
                        start_in_background(&mut result, children);
                        result
                    }
                }
            }
        };
        // The calls' events come before the step's own, as the engine commits them.
        result.events.splice(0..0, call_events);
        Ok(Some(result))
    }

    /// A `never` call of the claimed step: its intent is written ahead, then its outcome.
    /// None when the worker gave the step up: a write was refused, or it crashed between the
    /// two.
    async fn write_ahead(
        &self,
        claimed: &ClaimedStep,
        slot: u32,
        call: &ToolCall,
        announce: EventDraft,
        tools_fail: bool,
        crash: bool,
    ) -> Result<Option<ToolOutcome>, Mismatch> {
        let (claim, now) = (&claimed.claim, self.now);
        let intent = Intent {
            slot,
            kind: IntentKind::Tool,
            name: call.name.clone(),
            idempotency_key: call_key(claimed, slot),
        };
        let recorded = self
            .both("record_intents", async |s| {
                (s.record_intents(claim, vec![intent.clone()], vec![announce.clone()], now)).await
            })
            .await?;
        if recorded.is_err() || crash {
            return Ok(None);
        }
        let outcome = ran(tools_fail, "charged");
        let recorded = self
            .both("record_outcome", async |s| {
                s.record_outcome(claim, slot, outcome.clone(), now).await
            })
            .await?;
        Ok(recorded.is_ok().then_some(outcome))
    }

    /// An `emit_signal` call of the claimed step, as the engine's tool makes it.
    async fn emit_signal(
        &mut self,
        claimed: &ClaimedStep,
        slot: u32,
        call: &ToolCall,
    ) -> Result<ToolOutcome, Mismatch> {
        let state = &claimed.state;
        let Some(contract) = &state.config.signal else {
            return Ok(ToolOutcome::error("this run has no signal contract"));
        };
        let request = match parse_signal(&call.arguments, contract) {
            Ok(request) => request,
            Err(refusal) => return Ok(ToolOutcome::error(refusal)),
        };
        let signal = NewSignal {
            call_key: call_key(claimed, slot),
            dedupe_key: request.dedupe_key().to_owned(),
            payload: json!({
                "from_run_id": claimed.claim.run_id,
                "agent": state.lineage.as_ref().map(|l| &l.agent),
                "severity": request.severity,
                "summary": request.summary,
                "details": request.details,
            }),
        };
        let emitted = self
            .both("emit_signal", async |s| {
                (s.emit_signal(&claimed.claim, signal.clone(), self.now)).await
            })
            .await?;
        self.tally.signals += usize::from(emitted.is_ok());
        Ok(match emitted.map(|emitted| emitted.outcome) {
            Ok(SignalOutcome::Sent(event)) => {
                ToolOutcome::ok(json!({"sent": true, "event": event}).to_string())
            }
            Ok(SignalOutcome::Duplicate(event)) => {
                ToolOutcome::ok(json!({"sent": false, "event": event}).to_string())
            }
            Ok(SignalOutcome::Refused(why)) => ToolOutcome::error(why),
            Err(error) => ToolOutcome::error(format!("emit_signal failed: {error}")),
        })
    }

    /// Whether the delegation `call` fits the tree's size and, in the background, the root
    /// session's inbox, as the engine checks before it commits (and tells the model why not).
    async fn admit(
        &self,
        claimed: &ClaimedStep,
        call: &ToolCall,
    ) -> Result<Result<(), String>, Mismatch> {
        let run = claimed.job.run_id.clone();
        let admission = match self
            .both("admission", async |s| s.admission(&run).await)
            .await?
        {
            Ok(admission) => admission,
            Err(error) => return Ok(Err(error.to_string())),
        };
        let delegation = &claimed.state.config.delegation;
        let tasks = call.arguments["tasks"].as_array().map_or(0, Vec::len) as u64;
        let places = match (
            call.arguments["mode"].as_str(),
            call.arguments["completion_policy"].as_str(),
        ) {
            (Some("background"), Some("each")) => tasks,
            (Some("background"), _) => 1,
            _ => 0,
        };
        if admission.inbox_held + places > u64::from(delegation.inbox.capacity) {
            return Ok(Err("the inbox is full".into()));
        }
        if admission.tree_runs + tasks > delegation.max_tree_runs {
            return Ok(Err("the tree is full".into()));
        }
        Ok(Ok(()))
    }

    fn children(
        &mut self,
        parent: &ClaimedStep,
        slot: u32,
        call: &ToolCall,
        background: Option<CompletionPolicy>,
    ) -> Vec<ChildRun> {
        let state = &parent.state;
        let delegation = &state.config.delegation;
        let (root_run_id, root_session_id, depth) = match &state.lineage {
            Some(l) => (l.root_run_id.clone(), l.root_session_id.clone(), l.depth),
            None => (state.run_id.clone(), state.session_id.clone(), 0),
        };
        let tasks = call.arguments["tasks"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        (0u32..)
            .zip(tasks)
            .map(|(task_index, task)| {
                let suffix = self.names.fresh();
                let agent = task["agent"].as_str().unwrap_or_default();
                let profile = delegation.agent(agent).expect("a profile of the run");
                let mut config = profile.config.clone();
                config.delegation.max_depth = delegation.max_depth;
                config.delegation.max_tree_runs = delegation.max_tree_runs;
                // Only a background run may signal before it ends.
                match (&config.signal, background) {
                    (Some(contract), Some(_)) => config.tools.push(emit_signal_tool(contract)),
                    _ => config.signal = None,
                }
                ChildRun {
                    run_id: RunId::from_suffix(&suffix).unwrap(),
                    session_id: SessionId::from_suffix(&suffix).unwrap(),
                    message_id: MessageId::from_suffix(&suffix).unwrap(),
                    task: task["task"].as_str().unwrap_or_default().to_owned(),
                    call_id: call.id.clone(),
                    config,
                    lineage: Lineage {
                        parent_run_id: state.run_id.clone(),
                        parent_step: parent.job.step_index,
                        parent_slot: slot,
                        task_index,
                        root_run_id: root_run_id.clone(),
                        root_session_id: root_session_id.clone(),
                        depth: depth + 1,
                        agent: agent.to_owned(),
                        background: background.map(|policy| {
                            BackgroundGroup::new(&state.run_id, parent.job.step_index, slot, policy)
                        }),
                    },
                }
            })
            .collect()
    }
}

/// Where the engine cuts a context to compact it: the earliest message from which the rest
/// fits `budget` estimated tokens, moved past tool results (each stays with its call).
fn compaction_cut(context: &[StoredMessage], budget: u64) -> usize {
    let mut kept = 0u64;
    let mut cut = context.len();
    for (i, stored) in context.iter().enumerate().rev() {
        kept += stored.message.estimated_tokens();
        if kept > budget {
            break;
        }
        cut = i;
    }
    while (context.get(cut)).is_some_and(|m| m.message.role == Role::Tool) {
        cut += 1;
    }
    cut
}

/// What a tool that runs answers.
fn ran(tools_fail: bool, ok: &str) -> ToolOutcome {
    if tools_fail {
        ToolOutcome::error("the tool failed")
    } else {
        ToolOutcome::ok(ok)
    }
}

/// The idempotency key of the claimed step's call at `slot`, as the engine makes it: named
/// after the batch's first step, so it survives a wait that moves the batch on.
fn call_key(claimed: &ClaimedStep, slot: u32) -> String {
    let job = &claimed.job;
    match &claimed.state.checkpoint {
        Some(checkpoint) => checkpoint.idempotency_key(&job.run_id, job.step_index, slot),
        None => format!("{}#{}#{slot}", job.run_id, job.step_index),
    }
}

/// Applies `ops` to both stores, comparing every answer and, after each operation, what
/// both show (and, at the end, everything they show); the first disagreement is the error.
async fn run_case(model: &dyn Store, backend: &dyn Store, ops: &[Op]) -> Result<Tally, Mismatch> {
    let mut harness = Harness::new(model, backend);
    harness.start().await?;
    for (i, op) in ops.iter().enumerate() {
        let described = |mismatch: Mismatch| format!("after op #{i} {op:?}: {mismatch}");
        harness.apply(op).await.map_err(described)?;
        harness.compare_snapshots(false).await.map_err(described)?;
    }
    (harness.compare_snapshots(true).await)
        .map_err(|mismatch| format!("at the end: {mismatch}"))?;
    Ok(harness.tally)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        // Enough to bring a failing sequence of `MAX_OPS` down to the few operations that
        // matter (proptest's default, four per case, often stops short of that).
        max_shrink_iters: 20 * cases,
        // A runner outside the `proptest!` macro has no source file to save failures beside:
        // a failure is reported with its shrunk sequence instead.
        failure_persistence: None,
        ..Config::default()
    })
}

/// Runs `cases` cases of the model against the backends `open` makes, and fails with the
/// shortest sequence that disagrees. Each case gets a fresh backend (and the guard that keeps
/// it alive): what a database numbers itself (message positions, inbox event ids, the
/// continuation runs named after them) then counts from 1 as the model counts it, so no
/// answer needs normalising.
fn check_against<S: Store, G>(cases: u32, open: impl Fn() -> (S, G)) {
    let runtime = runtime();
    let totals = Cell::new((Tally::default(), 0usize));
    let outcome = runner(cases).run(&ops(), |ops| {
        // The store is dropped before its guard (a tuple drops its fields in order).
        let backend = open();
        let model = MemoryStore::new();
        let tally = runtime
            .block_on(run_case(&model, &backend.0, &ops))
            .map_err(TestCaseError::fail)?;
        let (mut sum, committing) = totals.get();
        sum.add(tally);
        totals.set((sum, committing + usize::from(tally.commits > 0)));
        Ok(())
    });
    match outcome {
        Ok(()) => {}
        Err(TestError::Fail(reason, ops)) => {
            panic!("{reason}\nthe shortest sequence found: {ops:#?}")
        }
        Err(error) => panic!("{error}"),
    }
    let (sum, committing) = totals.get();
    eprintln!("{cases} cases, {committing} of them committing steps: {sum:?}");
    // Sequences that never commit a step would compare little but empty sessions.
    assert!(
        committing * 3 >= cases as usize,
        "too few cases committed a step: {committing} of {cases}"
    );
}

#[test]
fn the_model_agrees_with_sqlite() {
    check_against(48, || {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("ratchet.db");
        let store = ratchet_sqlite::open_url(&format!("sqlite://{}", path.display()))
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        (store, dir)
    });
}

#[test]
fn the_model_agrees_with_postgres() {
    // Whether the server is there is decided once, skipping (or, in CI, failing) as every
    // PostgreSQL test does; then each case gets a database of its own.
    let Some(probe) = TestDatabase::create() else {
        return;
    };
    drop(probe);
    check_against(16, || {
        let database = TestDatabase::create().expect("the server answered a moment ago");
        let store = ratchet_postgres::open_url(database.url())
            .unwrap_or_else(|e| panic!("open {}: {e}", database.url()));
        (store, database)
    });
}

/// The comparison is not vacuous: two models given the same operations agree, but a store
/// holding one run more, or a session the case is about to create, is told apart at once,
/// and proptest shrinks such a failure to a single operation.
#[test]
fn the_harness_sees_a_difference() {
    check_against(16, || (MemoryStore::new(), ()));

    let runtime = runtime();
    let one_run_more = runner(16).run(&ops(), |ops| {
        let (left, right) = (MemoryStore::new(), MemoryStore::new());
        runtime.block_on(async {
            let other = SessionId::from_suffix("other").unwrap();
            right
                .create_session(&other, SessionSpec::default(), T0)
                .await
                .unwrap();
            let only_here = NewRun {
                session_id: other,
                run_id: RunId::from_suffix("other").unwrap(),
                message_id: MessageId::from_suffix("other").unwrap(),
                content: "only here".into(),
                config: user_config(),
                when_busy: WhenBusy::Enqueue,
                quota: RunQuota::default(),
                trace: None,
                request: None,
            };
            right.submit_message(only_here, T0).await.unwrap();
            run_case(&left, &right, &ops)
                .await
                .map_err(TestCaseError::fail)
        })?;
        Ok(())
    });
    match one_run_more {
        Err(TestError::Fail(reason, shortest)) => {
            assert!(reason.message().contains("list_runs differs"), "{reason}");
            assert_eq!(shortest.len(), 1, "shrunk to one operation: {shortest:?}");
        }
        other => panic!("a store with one run more went unnoticed: {other:?}"),
    }

    let (left, right) = (MemoryStore::new(), MemoryStore::new());
    let mismatch = runtime.block_on(async {
        let taken = SessionId::from_suffix("case-1").unwrap();
        right
            .create_session(&taken, SessionSpec::default(), T0)
            .await
            .unwrap();
        run_case(&left, &right, &[]).await
    });
    match mismatch {
        Err(reason) => assert!(
            reason.contains("create_session answered differently"),
            "{reason}"
        ),
        Ok(_) => panic!("a session created on one side only went unnoticed"),
    }
}
