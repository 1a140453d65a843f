//! The in-memory model and the SQL backends tell the same story. Random sequences of what the
//! Coordinator does — user messages (queued, interrupting, steering), claims by two workers,
//! commits of the step results the engine would build, stale and repeated commits, heartbeats,
//! retries, expired and released leases, cancels, pauses and resumes, approvals and their
//! answers, delegations and their joins — are applied to the model and to a backend side by
//! side. After every operation both must have answered alike, and everything `Reads` shows of
//! them must be equal; a disagreement is shrunk by proptest to a shortest sequence showing it.
//!
//! One test per backend (PostgreSQL only where `RATCHET_TEST_POSTGRES_URL` names a server),
//! and one proving that the comparison does fail when the two stores differ.

use std::cell::Cell;
use std::fmt::Debug;

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestError, TestRunner};
use ratchet_core::delegation::{ChildRun, DELEGATE_TOOL, await_children, delegate_tool};
use ratchet_core::step::{
    after_compaction, after_model, after_tools, ask_approval_step, finish_step,
};
use ratchet_core::{
    AgentProfile, ApprovalAnswer, ApprovalPolicy, CallDecision, DelegationConfig, EventDraft,
    EventKind, Instruction, Limits, Lineage, MessageId, Millis, ModelReply, ReplayPolicy,
    RunConfigSnapshot, RunId, SessionId, StepResult, StopReason, ToolCall, ToolOutcome, ToolSpec,
    Usage, Verdict, decide,
};
use ratchet_postgres::testkit::TestDatabase;
use ratchet_store::{
    ClaimedStep, Commit, DEFAULT_TENANT, Error, Lease, NewRun, RunQuota, SessionQuery, SessionSpec,
    Store, WhenBusy, Writes,
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
const MAX_OPS: usize = 40;

/// One thing the Coordinator does, with the choices it leaves to the test.
#[derive(Debug, Clone)]
enum Op {
    Submit {
        session: usize,
        when_busy: WhenBusy,
        /// Admitted within a small per-session quota, rather than none.
        within_quota: bool,
    },
    /// A claim by `worker`, or by the other one when `worker` is busy.
    Claim {
        worker: usize,
    },
    /// The worker carries out its claimed step (claiming one first when it holds none) and
    /// commits the result.
    Commit {
        worker: usize,
        model: ModelTurn,
        tools_fail: bool,
        /// Asks to keep the run's next step under the worker's lease.
        keep_going: bool,
    },
    /// A claim given up earlier (committed, lost, retried, released) commits again.
    CommitAgain {
        claim: Index,
    },
    /// The busy worker, `worker` first, extends its lease.
    Heartbeat {
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
    Answer {
        approval: Index,
        answer: HumanAnswer,
    },
}

/// What the model answers when a step calls it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum ModelTurn {
    Text,
    Lookup,
    /// A batch in which one call needs a human's approval.
    Guarded,
    Delegate {
        tasks: usize,
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
    let model = prop_oneof![
        3 => Just(ModelTurn::Text),
        3 => Just(ModelTurn::Lookup),
        3 => Just(ModelTurn::Guarded),
        3 => (1..=2usize).prop_map(|tasks| ModelTurn::Delegate { tasks }),
        1 => Just(ModelTurn::Fail),
    ];
    let answer = prop_oneof![
        Just(HumanAnswer::Approve),
        Just(HumanAnswer::Deny),
        Just(HumanAnswer::Abort),
    ];
    prop_oneof![
        4 => (0..SESSIONS, when_busy, prop::bool::weighted(0.1)).prop_map(
            |(session, when_busy, within_quota)| Op::Submit { session, when_busy, within_quota }
        ),
        3 => worker.clone().prop_map(|worker| Op::Claim { worker }),
        10 => (worker.clone(), model, prop::bool::weighted(0.2), any::<bool>()).prop_map(
            |(worker, model, tools_fail, keep_going)| Op::Commit { worker, model, tools_fail, keep_going }
        ),
        1 => any::<Index>().prop_map(|claim| Op::CommitAgain { claim }),
        1 => worker.clone().prop_map(|worker| Op::Heartbeat { worker }),
        1 => worker.clone().prop_map(|worker| Op::RetryLater { worker }),
        1 => Just(Op::ExpireLeases),
        1 => worker.prop_map(|worker| Op::ReleaseLeases { worker }),
        1 => any::<Index>().prop_map(|run| Op::Cancel { run }),
        1 => any::<Index>().prop_map(|run| Op::Pause { run }),
        1 => any::<Index>().prop_map(|run| Op::Resume { run }),
        3 => (any::<Index>(), answer).prop_map(|(approval, answer)| Op::Answer { approval, answer }),
    ]
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(), 1..=MAX_OPS)
}

fn tool(name: &str, approval: ApprovalPolicy) -> ToolSpec {
    ToolSpec {
        name: name.into(),
        description: String::new(),
        parameters: json!({"type": "object"}),
        replay: ReplayPolicy::Safe,
        completes_run: false,
        approval,
        delegation: Default::default(),
        calls: Default::default(),
    }
}

/// A delegated run's configuration: tools, one of them gated, and a few steps only, so that
/// longer runs meet their budget.
fn worker_config() -> RunConfigSnapshot {
    RunConfigSnapshot {
        model: "scripted:model-test".into(),
        tools: vec![
            tool("lookup", ApprovalPolicy::Never),
            tool("guarded", ApprovalPolicy::Always),
        ],
        limits: Limits {
            max_steps: 8,
            ..Limits::default()
        },
        ..RunConfigSnapshot::default()
    }
}

/// A user's run: a worker's tools, and delegation to workers in a small tree.
fn user_config() -> RunConfigSnapshot {
    let worker = AgentProfile {
        id: "worker".into(),
        description: "does the work".into(),
        config: worker_config(),
    };
    let mut config = worker_config();
    config
        .tools
        .push(delegate_tool(std::slice::from_ref(&worker)));
    config.delegation = DelegationConfig {
        agents: vec![worker],
        max_depth: 2,
        max_tree_runs: 6,
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
        ModelTurn::Delegate { tasks } => {
            let tasks: Vec<Value> = (0..tasks)
                .map(|i| json!({"agent": "worker", "task": format!("task {i}")}))
                .collect();
            (
                "handing out",
                vec![call(
                    "call-1",
                    DELEGATE_TOOL,
                    json!({"mode": "foreground", "tasks": tasks}),
                )],
            )
        }
    };
    ModelReply {
        text: text.into(),
        tool_calls,
        usage: Usage {
            input_tokens: 12,
            output_tokens: 5,
            reasoning_tokens: 0,
        },
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

/// Everything a reader can see of a store, section by section.
async fn snapshot(store: &dyn Store, roots: &[SessionId], now: Millis) -> Vec<(String, String)> {
    let mut sections = Vec::new();
    // Neither backend promises an order for these lists.
    let mut runs = store.list_runs().await;
    if let Ok(runs) = &mut runs {
        runs.sort_by(|a, b| a.run_id.cmp(&b.run_id));
    }
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
        stats
            .runs_by_status
            .sort_by_key(|(status, _)| status.as_str());
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
    }
    for run in runs.iter().flatten() {
        let id = &run.run_id;
        let mut section = |call: &str, shown: String| {
            sections.push((format!("{call} {id}"), shown));
        };
        section("load_state", outcome(&store.load_state(id).await));
        section("steps", outcome(&store.steps(id).await));
        section(
            "context",
            outcome(&store.context(&run.session_id, id).await),
        );
        section("run_tree", outcome(&store.run_tree(id).await));
    }
    sections
}

/// Ids the test chooses, the same for both stores: a prefix and a counter.
struct Names {
    prefix: String,
    next: u64,
}

impl Names {
    fn fresh(&mut self) -> String {
        self.next += 1;
        format!("{}-{}", self.prefix, self.next)
    }
}

/// What a case has done so far, for the report of the whole test.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    commits: usize,
    stale_commits: usize,
    children: usize,
    approvals_answered: usize,
}

/// One case: the model and a backend, and what the test knows of them. Everything handed to
/// a store is derived from this, never from one store's answer unless both answered alike.
struct Harness<'a> {
    model: &'a dyn Store,
    backend: &'a dyn Store,
    names: Names,
    now: Millis,
    sessions: Vec<SessionId>,
    /// Every run id the test named (a steer's may never become a run).
    runs: Vec<RunId>,
    held: [Option<ClaimedStep>; 2],
    /// Claims their workers no longer use, for committing again.
    earlier: Vec<ClaimedStep>,
    tally: Tally,
}

type Mismatch = String;

impl<'a> Harness<'a> {
    fn new(model: &'a dyn Store, backend: &'a dyn Store, prefix: &str) -> Harness<'a> {
        Harness {
            model,
            backend,
            names: Names {
                prefix: prefix.to_owned(),
                next: 0,
            },
            now: T0,
            sessions: Vec::new(),
            runs: Vec::new(),
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

    async fn compare_snapshots(&self) -> Result<(), Mismatch> {
        let expected = snapshot(self.model, &self.sessions, self.now).await;
        let found = snapshot(self.backend, &self.sessions, self.now).await;
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
        self.compare_snapshots().await
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
                };
                self.same("submit_message", async |s| {
                    s.submit_message(new.clone(), now).await
                })
                .await?;
                self.runs.push(new.run_id);
            }
            Op::Claim { worker } => {
                if let Some(worker) = self.idle_worker(worker) {
                    self.claim(worker).await?;
                }
            }
            Op::Commit {
                worker,
                model,
                tools_fail,
                keep_going,
            } => {
                if self.held[worker].is_none() {
                    self.claim(worker).await?;
                }
                let Some(claimed) = self.held[worker].take() else {
                    return Ok(());
                };
                let result = self.step_result(&claimed, model, tools_fail).await?;
                let children: Vec<RunId> =
                    result.children.iter().map(|c| c.run_id.clone()).collect();
                let continue_with = keep_going.then(|| lease(worker, now + LEASE_MS));
                let commit = self
                    .both("commit_step", async |s| {
                        s.commit_step(&claimed.claim, result.clone(), continue_with.clone(), now)
                            .await
                    })
                    .await?;
                match commit {
                    Ok(Commit::Committed { continued, .. }) => {
                        self.tally.commits += 1;
                        self.tally.children += children.len();
                        self.runs.extend(children);
                        self.held[worker] = continued;
                    }
                    Ok(Commit::Stale(_)) => self.tally.stale_commits += 1,
                    Err(_) => {}
                }
                self.earlier.push(claimed);
            }
            Op::CommitAgain { claim } => {
                if self.earlier.is_empty() {
                    return Ok(());
                }
                let claimed = claim.get(&self.earlier).clone();
                let result = self.step_result(&claimed, ModelTurn::Text, false).await?;
                let children: Vec<RunId> =
                    result.children.iter().map(|c| c.run_id.clone()).collect();
                let commit = self
                    .both("commit_step (again)", async |s| {
                        s.commit_step(&claimed.claim, result.clone(), None, now)
                            .await
                    })
                    .await?;
                match commit {
                    Ok(Commit::Committed { .. }) => {
                        self.tally.commits += 1;
                        self.tally.children += children.len();
                        self.runs.extend(children);
                    }
                    Ok(Commit::Stale(_)) => self.tally.stale_commits += 1,
                    Err(_) => {}
                }
            }
            Op::Heartbeat { worker } => {
                let Some(worker) = self.busy_worker(worker) else {
                    return Ok(());
                };
                let claim = self.held[worker]
                    .as_ref()
                    .expect("a busy worker")
                    .claim
                    .clone();
                self.same("heartbeat", async |s| {
                    s.heartbeat(&claim, now + LEASE_MS).await
                })
                .await?;
            }
            Op::RetryLater { worker } => {
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
                    s.retry_later(&claimed.claim, now + RETRY_MS, event.clone(), now)
                        .await
                })
                .await?;
                self.earlier.push(claimed);
            }
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
                let Some(run) = self.pick_run(run) else {
                    return Ok(());
                };
                self.same("request_cancel", async |s| {
                    s.request_cancel(&run, now).await
                })
                .await?;
            }
            Op::Pause { run } => {
                let Some(run) = self.pick_run(run) else {
                    return Ok(());
                };
                self.same("request_pause", async |s| s.request_pause(&run, now).await)
                    .await?;
            }
            Op::Resume { run } => {
                let Some(run) = self.pick_run(run) else {
                    return Ok(());
                };
                self.same("resume_paused", async |s| s.resume_paused(&run, now).await)
                    .await?;
            }
            Op::Answer { approval, answer } => {
                let Ok(approvals) = self
                    .both("approvals", async |s| {
                        s.approvals(DEFAULT_TENANT, None, None, 1_000).await
                    })
                    .await?
                else {
                    return Ok(());
                };
                if approvals.is_empty() {
                    return Ok(());
                }
                let approval = approval.get(&approvals);
                let decide_call = |needs_approval: bool| match answer {
                    HumanAnswer::Deny if needs_approval => Verdict::Deny,
                    _ => Verdict::Approve,
                };
                let answer = match answer {
                    HumanAnswer::Abort => ApprovalAnswer::Abort,
                    HumanAnswer::Approve | HumanAnswer::Deny => ApprovalAnswer::Decisions(
                        (approval.calls.iter())
                            .map(|call| CallDecision {
                                call_id: call.call_id.clone(),
                                decision: decide_call(call.needs_approval),
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
                if answered.is_ok() {
                    self.tally.approvals_answered += 1;
                }
            }
        }
        Ok(())
    }

    /// The idle `worker` claims the next job, if there is one.
    async fn claim(&mut self, worker: usize) -> Result<(), Mismatch> {
        let now = self.now;
        let lease = lease(worker, now + LEASE_MS);
        let expected = self.model.claim_next(lease.clone(), None, now).await;
        // Among jobs due at the same instant the order is not part of the contract (SQL
        // orders by `ready_at` alone): the backend is asked for the model's pick.
        let picked = match &expected {
            Ok(Some(claimed)) => Some(claimed.job.run_id.clone()),
            _ => None,
        };
        let found = self.backend.claim_next(lease, picked.as_ref(), now).await;
        agree("claim_next", &expected, &found)?;
        if let Ok(Some(claimed)) = expected {
            self.held[worker] = Some(claimed);
        }
        Ok(())
    }

    /// `worker` if it holds no claim (a worker runs one step at a time), else the other one
    /// if it holds none: so that a sequence rarely asks for what cannot be done.
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

    fn pick_run(&self, index: Index) -> Option<RunId> {
        (!self.runs.is_empty()).then(|| index.get(&self.runs).clone())
    }

    /// What the engine would commit for `claimed`: the Brain's instruction for its step,
    /// carried out with the model answering `model` and tools succeeding unless `tools_fail`.
    async fn step_result(
        &mut self,
        claimed: &ClaimedStep,
        model: ModelTurn,
        tools_fail: bool,
    ) -> Result<StepResult, Mismatch> {
        let (state, job, now) = (claimed.state.clone(), &claimed.job, self.now);
        Ok(match decide(&state, job.phase, now) {
            Instruction::Finish(reason) => finish_step(state, job, reason, now, now),
            Instruction::AskApproval => ask_approval_step(state, job, now, now),
            Instruction::CompressContext => after_compaction(state, job, None, now, now),
            Instruction::CallLlm { .. } if model == ModelTurn::Fail => {
                finish_step(state, job, StopReason::LlmError, now, now)
            }
            Instruction::CallLlm { conclude } => {
                after_model(state, job, model_reply(model), conclude, now, now)
            }
            Instruction::CallToolsBatch => self.run_batch(claimed, tools_fail).await?,
        })
    }

    /// The batch of the claimed step, as the engine runs it: outcomes known before are kept,
    /// a call of a tool the run was not offered is invalid, a delegation within the tree's
    /// size starts its children and the run waits for them.
    async fn run_batch(
        &mut self,
        claimed: &ClaimedStep,
        tools_fail: bool,
    ) -> Result<StepResult, Mismatch> {
        let (state, job, now) = (&claimed.state, &claimed.job, self.now);
        let calls = (state.checkpoint.as_ref())
            .map(|c| c.calls.clone())
            .unwrap_or_default();
        let mut outcomes = Vec::new();
        let mut invalid = 0;
        let mut delegated = None;
        for (slot, progress) in (0u32..).zip(&calls) {
            let call = &progress.call;
            let outcome = if let Some(known) = &progress.outcome {
                Some(known.clone())
            } else if state.config.tool(&call.name).is_none() {
                invalid += 1;
                Some(ToolOutcome::error(format!(
                    "there is no tool {:?}",
                    call.name
                )))
            } else if call.name == DELEGATE_TOOL {
                delegated = Some((slot, call.clone()));
                None
            } else if tools_fail {
                Some(ToolOutcome::error("the lookup failed"))
            } else {
                Some(ToolOutcome::ok("found it"))
            };
            outcomes.push(outcome);
        }
        if let Some((slot, call)) = delegated {
            let tasks = call.arguments["tasks"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let run_id = state.run_id.clone();
            let admission = self
                .both("admission", async |s| s.admission(&run_id).await)
                .await?;
            let limit = state.config.delegation.max_tree_runs;
            // The engine checks the tree's size before committing, and tells the model.
            if admission.is_ok_and(|a| a.tree_runs + tasks.len() as u64 <= limit) {
                let children = self.children(claimed, slot, &call.id, &tasks);
                return Ok(await_children(
                    state.clone(),
                    job,
                    outcomes,
                    children,
                    now,
                    now,
                ));
            }
            outcomes[slot as usize] = Some(ToolOutcome::error("the tree is full"));
        }
        let outcomes = outcomes.into_iter().flatten().collect();
        Ok(after_tools(state.clone(), job, outcomes, invalid, now, now))
    }

    fn children(
        &mut self,
        parent: &ClaimedStep,
        slot: u32,
        call_id: &str,
        tasks: &[Value],
    ) -> Vec<ChildRun> {
        let state = &parent.state;
        let delegation = &state.config.delegation;
        let (root_run_id, root_session_id, depth) = match &state.lineage {
            Some(l) => (l.root_run_id.clone(), l.root_session_id.clone(), l.depth),
            None => (state.run_id.clone(), state.session_id.clone(), 0),
        };
        let profile = delegation.agent("worker").expect("the worker profile");
        (0u32..)
            .zip(tasks)
            .map(|(task_index, task)| {
                let suffix = self.names.fresh();
                let mut config = profile.config.clone();
                config.delegation.max_depth = delegation.max_depth;
                config.delegation.max_tree_runs = delegation.max_tree_runs;
                ChildRun {
                    run_id: RunId::from_suffix(&suffix).unwrap(),
                    session_id: SessionId::from_suffix(&suffix).unwrap(),
                    message_id: MessageId::from_suffix(&suffix).unwrap(),
                    task: task["task"].as_str().unwrap_or_default().to_owned(),
                    call_id: call_id.to_owned(),
                    config,
                    lineage: Lineage {
                        parent_run_id: state.run_id.clone(),
                        parent_step: parent.job.step_index,
                        parent_slot: slot,
                        task_index,
                        root_run_id: root_run_id.clone(),
                        root_session_id: root_session_id.clone(),
                        depth: depth + 1,
                        agent: "worker".into(),
                        background: None,
                    },
                }
            })
            .collect()
    }
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

/// Applies `ops` to both stores, comparing every answer and, after each operation, what
/// both show; the first disagreement is the error.
async fn run_case(
    model: &dyn Store,
    backend: &dyn Store,
    prefix: &str,
    ops: &[Op],
) -> Result<Tally, Mismatch> {
    let mut harness = Harness::new(model, backend, prefix);
    harness.start().await?;
    for (i, op) in ops.iter().enumerate() {
        let described = |mismatch: Mismatch| format!("after op #{i} {op:?}: {mismatch}");
        harness.apply(op).await.map_err(described)?;
        harness.compare_snapshots().await.map_err(described)?;
    }
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
        failure_persistence: None,
        ..Config::default()
    })
}

/// Runs `cases` cases of the model against the backends `open` makes (one per case, with
/// the guard that keeps it alive), and fails with the shortest sequence that disagrees.
fn check_against<S: Store, G>(cases: u32, open: impl Fn() -> (S, G)) {
    let runtime = runtime();
    let totals = Cell::new((Tally::default(), 0usize));
    let outcome = runner(cases).run(&ops(), |ops| {
        // The store is dropped before its guard (a tuple drops its fields in order).
        let backend = open();
        let model = MemoryStore::new();
        let tally = runtime
            .block_on(run_case(&model, &backend.0, "m", &ops))
            .map_err(TestCaseError::fail)?;
        let (mut sum, committing) = totals.get();
        sum.commits += tally.commits;
        sum.stale_commits += tally.stale_commits;
        sum.children += tally.children;
        sum.approvals_answered += tally.approvals_answered;
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
    let runtime = runtime();
    check_against(16, || (MemoryStore::new(), ()));

    let one_run_more = runner(4).run(&ops(), |ops| {
        let (left, right) = (MemoryStore::new(), MemoryStore::new());
        runtime.block_on(async {
            let other = SessionId::from_suffix("other").unwrap();
            right
                .create_session(&other, SessionSpec::default(), T0)
                .await
                .unwrap();
            right
                .submit_message(
                    NewRun {
                        session_id: other,
                        run_id: RunId::from_suffix("other").unwrap(),
                        message_id: MessageId::from_suffix("other").unwrap(),
                        content: "only here".into(),
                        config: user_config(),
                        when_busy: WhenBusy::Enqueue,
                        quota: RunQuota::default(),
                    },
                    T0,
                )
                .await
                .unwrap();
            run_case(&left, &right, "m", &ops)
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
        let taken = SessionId::from_suffix("m-1").unwrap();
        right
            .create_session(&taken, SessionSpec::default(), T0)
            .await
            .unwrap();
        run_case(&left, &right, "m", &[]).await
    });
    match mismatch {
        Err(reason) => assert!(
            reason.contains("create_session answered differently"),
            "{reason}"
        ),
        Ok(_) => panic!("a session created on one side only went unnoticed"),
    }
}
