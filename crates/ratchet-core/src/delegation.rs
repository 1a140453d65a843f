//! Sub-agents: which tools a child run may be offered, what a run may delegate to, the
//! `delegate` request a model makes, and the two transitions of a foreground delegation — the
//! step that parks a parent on its children, and the join that wakes it with their results.
//!
//! A child run is an ordinary run in a session of its own: the same steps, the same recovery.
//! Its parent waits `waiting_children` without a job (so it holds no worker and no permit);
//! the join happens once, in the transaction that ends the last of the children.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::inbox::{CompletionPolicy, InboxPolicy};
use crate::step::{
    DecisionError, Phase, StepJob, StepResult, back_to_running, park_batch, status_event,
};
use crate::{
    AgentState, EventDraft, EventKind, MessageId, Millis, ReplayPolicy, RunConfigSnapshot, RunId,
    RunStatus, SessionId, StopReason, ToolOutcome, ToolSpec, TreeBudget,
};

/// The tool a model hands work to other agents with.
pub const DELEGATE_TOOL: &str = "delegate";
/// The tool a model looks after the runs it started with.
pub const AGENT_TASK_TOOL: &str = "agent_task";
/// The tool a background child reports to its root session with.
pub const EMIT_SIGNAL_TOOL: &str = "emit_signal";
/// The most tasks one `delegate` call may start.
pub const MAX_TASKS_PER_CALL: usize = 64;
/// The agent name a session gives to mean the server's own run template, as if it named none.
pub const DEFAULT_AGENT: &str = "default";
/// Agent names the runtime gives a meaning of its own, with that meaning: a catalog agent of
/// one of these names could never be reached, so a catalog may not define one.
pub const RESERVED_AGENT_IDS: &[(&str, &str)] = &[(
    DEFAULT_AGENT,
    "a session naming `default` runs the server's own run template",
)];

/// Whether a tool may be offered to child runs. Fails closed: a tool nobody marked is offered
/// to root runs only.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolDelegation {
    /// Root runs only.
    #[default]
    RootOnly,
    /// Any run whose definition lists it.
    Delegatable,
    /// Provided by the runtime itself (`delegate`, `agent_task`, `emit_signal`), where a run's
    /// position in its tree allows it.
    RuntimeInjected,
}

impl ToolDelegation {
    pub fn as_str(self) -> &'static str {
        match self {
            ToolDelegation::RootOnly => "root_only",
            ToolDelegation::Delegatable => "delegatable",
            ToolDelegation::RuntimeInjected => "runtime_injected",
        }
    }
}

/// The catalog definition a run was started from: its id and the hash of its file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentRef {
    pub id: String,
    pub hash: String,
}

/// An agent a run may hand work to, with the configuration its runs start with (frozen when
/// the delegating run was: the catalog may change, a running tree does not).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentProfile {
    pub id: String,
    pub description: String,
    pub config: RunConfigSnapshot,
}

/// What a run may delegate, frozen into its configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DelegationConfig {
    /// The agents this run's `delegate` tool may name.
    pub agents: Vec<AgentProfile>,
    /// How many levels of runs a tree may have below its root run (level 0).
    pub max_depth: u32,
    /// How many runs a tree may hold, its root included.
    pub max_tree_runs: u64,
    /// What every run of the tree may spend together (the root's, carried by each child).
    pub tree_budget: TreeBudget,
    /// How this run's background work reports back to its root session.
    pub inbox: InboxPolicy,
}

impl Default for DelegationConfig {
    fn default() -> Self {
        DelegationConfig {
            agents: Vec::new(),
            max_depth: 3,
            max_tree_runs: 256,
            tree_budget: TreeBudget::default(),
            inbox: InboxPolicy::default(),
        }
    }
}

impl DelegationConfig {
    pub fn agent(&self, id: &str) -> Option<&AgentProfile> {
        self.agents.iter().find(|a| a.id == id)
    }
}

/// Where a child run stands in its tree. Written when the child is created, never changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lineage {
    pub parent_run_id: RunId,
    /// The step of the parent that started this run, and the call of that step's batch.
    pub parent_step: u64,
    pub parent_slot: u32,
    /// This run's place among the tasks of that call.
    pub task_index: u32,
    pub root_run_id: RunId,
    pub root_session_id: SessionId,
    /// 1 for a child of a root run.
    pub depth: u32,
    pub agent: String,
    /// Set for a background run: it reports to the root session's inbox, not to its parent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub background: Option<BackgroundGroup>,
}

/// The background runs one `delegate` call started, and when they report back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackgroundGroup {
    /// `{parent run}#{step}#{slot}`: one group per call.
    pub group: String,
    pub policy: CompletionPolicy,
}

impl BackgroundGroup {
    pub fn new(parent: &RunId, step: u64, slot: u32, policy: CompletionPolicy) -> Self {
        BackgroundGroup {
            group: format!("{parent}#{step}#{slot}"),
            policy,
        }
    }
}

/// Whether the `delegate` call waits for its children or returns at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DelegationMode {
    Foreground,
    Background,
}

/// The arguments of a `delegate` call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DelegateRequest {
    pub mode: DelegationMode,
    pub tasks: Vec<DelegateTask>,
    /// Background only: one report when all runs have ended (the default), or one each.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_policy: Option<CompletionPolicy>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DelegateTask {
    pub agent: String,
    pub task: String,
    #[serde(default)]
    pub context: Option<String>,
}

impl DelegateTask {
    /// The user message the child run starts with.
    pub fn message(&self) -> String {
        match self.context.as_deref().map(str::trim) {
            Some(context) if !context.is_empty() => {
                format!("{}\n\nContext:\n{context}", self.task)
            }
            _ => self.task.clone(),
        }
    }
}

/// Reads a `delegate` call of a run at tree depth `depth` (0 for a root run). The error is
/// shown to the model, so it says what was expected.
pub fn parse_delegate(
    arguments: &Value,
    delegation: &DelegationConfig,
    depth: u32,
) -> Result<DelegateRequest, String> {
    let request: DelegateRequest = serde_json::from_value(arguments.clone()).map_err(|e| {
        format!(
            "invalid delegate arguments: {e}; expected {{\"mode\": \"foreground\" | \"background\", \"tasks\": [{{\"agent\": ID, \"task\": TEXT, \"context\": TEXT (optional)}}], \"completion_policy\": \"all\" | \"each\" (background only)}}"
        )
    })?;
    if request.mode == DelegationMode::Foreground && request.completion_policy.is_some() {
        return Err(
            "completion_policy applies to mode \"background\" only; a foreground call always returns every result together".into(),
        );
    }
    if request.tasks.is_empty() || request.tasks.len() > MAX_TASKS_PER_CALL {
        return Err(format!(
            "a delegate call takes 1 to {MAX_TASKS_PER_CALL} tasks, found {}",
            request.tasks.len()
        ));
    }
    if depth >= delegation.max_depth {
        return Err(format!(
            "delegation is limited to {} levels below the first run, and this run is at level {depth}; do the work yourself",
            delegation.max_depth
        ));
    }
    for (i, task) in request.tasks.iter().enumerate() {
        if delegation.agent(&task.agent).is_none() {
            let known: Vec<&str> = delegation.agents.iter().map(|a| a.id.as_str()).collect();
            return Err(format!(
                "task {i}: unknown agent {:?}; this run may delegate to: {}",
                task.agent,
                known.join(", ")
            ));
        }
        if task.task.trim().is_empty() {
            return Err(format!(
                "task {i}: the task is empty; say what {} should do",
                task.agent
            ));
        }
    }
    Ok(request)
}

/// The tools a child of an agent whose definition lists `listed` is offered: only those the
/// runtime marks delegatable. (`runtime_injected` tools are added by position, never listed.)
pub fn child_tools(offered: &[ToolSpec], listed: &[String]) -> Vec<ToolSpec> {
    offered
        .iter()
        .filter(|t| t.delegation == ToolDelegation::Delegatable && listed.contains(&t.name))
        .cloned()
        .collect()
}

/// The `delegate` tool as offered to a run that may delegate to `agents`.
pub fn delegate_tool(agents: &[AgentProfile]) -> ToolSpec {
    let ids: Vec<&str> = agents.iter().map(|a| a.id.as_str()).collect();
    let listing: Vec<String> = agents
        .iter()
        .map(|a| format!("- {}: {}", a.id, a.description))
        .collect();
    ToolSpec {
        calls: Default::default(),
        name: DELEGATE_TOOL.to_owned(),
        description: format!(
            "Hand tasks to other agents; they run concurrently. With mode \"foreground\" you wait for all of them and get one result per task, in order (its status and final answer, or why it failed). With mode \"background\" you get their run ids at once and go on; their results reach the conversation later, in a turn of their own (completion_policy \"all\": one report when every task has ended; \"each\": one per task). The agents:\n{}",
            listing.join("\n")
        ),
        parameters: json!({
            "type": "object",
            "properties": {
                "mode": {"type": "string", "enum": ["foreground", "background"]},
                "completion_policy": {"type": "string", "enum": ["all", "each"]},
                "tasks": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": MAX_TASKS_PER_CALL,
                    "items": {
                        "type": "object",
                        "properties": {
                            "agent": {"type": "string", "enum": ids},
                            "task": {"type": "string", "minLength": 1},
                            "context": {"type": "string"}
                        },
                        "required": ["agent", "task"],
                        "additionalProperties": false
                    }
                }
            },
            "required": ["mode", "tasks"],
            "additionalProperties": false
        }),
        // Nothing happens before the step commits: a redone step starts its children then.
        replay: ReplayPolicy::Safe,
        completes_run: false,
        approval: Default::default(),
        delegation: ToolDelegation::RuntimeInjected,
    }
}

/// The `agent_task` tool: a run looks after the runs below it in its tree.
pub fn agent_task_tool() -> ToolSpec {
    agent_task_spec(
        "Look after the runs you started (and theirs): `list` them, `get` one's status, `get_result` its final answer (a long one a page at a time: pass the `next_offset` it gives as `offset`), or `cancel` it.",
        &["list", "get", "get_result", "cancel"],
    )
}

/// The `agent_task` a continuation turn is given: it reads the runs whose reports it carries
/// (any run started from its session's tree), and may neither list nor cancel.
pub fn agent_task_for_reports_tool() -> ToolSpec {
    agent_task_spec(
        "Read a run a report names: `get` its status, or `get_result` its final answer (a long one a page at a time: pass the `next_offset` it gives as `offset`).",
        &["get", "get_result"],
    )
}

fn agent_task_spec(description: &str, actions: &[&str]) -> ToolSpec {
    ToolSpec {
        calls: Default::default(),
        name: AGENT_TASK_TOOL.to_owned(),
        description: description.to_owned(),
        parameters: json!({
            "type": "object",
            "properties": {
                "action": {"type": "string", "enum": actions},
                "run_id": {"type": "string"},
                "offset": {"type": "integer", "minimum": 0}
            },
            "required": ["action"],
            "additionalProperties": false
        }),
        replay: ReplayPolicy::Safe,
        completes_run: false,
        approval: Default::default(),
        delegation: ToolDelegation::RuntimeInjected,
    }
}

/// A child run a parent's step creates, in the same transaction that parks the parent.
#[derive(Debug, Clone, PartialEq)]
pub struct ChildRun {
    pub run_id: RunId,
    pub session_id: SessionId,
    pub message_id: MessageId,
    /// The user message it starts with.
    pub task: String,
    /// The parent's `delegate` call that started it.
    pub call_id: String,
    pub config: RunConfigSnapshot,
    pub lineage: Lineage,
}

/// The root run and root session of the tree `state`'s run is in: its lineage's, or its own
/// for a root run.
pub fn tree_root(state: &AgentState) -> (&RunId, &SessionId) {
    match &state.lineage {
        Some(l) => (&l.root_run_id, &l.root_session_id),
        None => (&state.run_id, &state.session_id),
    }
}

/// Whether a run tree of `existing` runs (ended ones included) may grow by `adding` within
/// `limit`; the refusal names the tree by its `root` run.
pub fn tree_has_room(root: &RunId, existing: u64, adding: u64, limit: u64) -> Result<(), String> {
    if existing.saturating_add(adding) > limit {
        return Err(format!(
            "the run tree of {root} has {existing} runs and may have at most {limit}"
        ));
    }
    Ok(())
}

/// The batch has a `delegate` call: its children start in this step's commit, and the run
/// waits for them. `outcomes` holds the batch's other calls' results (None for each
/// delegating call); they are kept in the checkpoint until the join hands every result to the
/// model in order.
pub fn await_children(
    mut state: AgentState,
    job: &StepJob,
    outcomes: Vec<Option<ToolOutcome>>,
    children: Vec<ChildRun>,
    started_at: Millis,
    now: Millis,
) -> StepResult {
    let summary = json!({
        "children": children.iter().map(|c| &c.run_id).collect::<Vec<_>>(),
    });
    let (record, committed) = park_batch(&mut state, job, outcomes, summary, started_at, now);
    state.status = RunStatus::WaitingChildren;
    let mut events: Vec<EventDraft> = (children.iter())
        .map(|child| child_started(&state.run_id, child))
        .collect();
    events.push(status_event(&state));
    events.push(committed);
    StepResult {
        record,
        state,
        messages: Vec::new(),
        events,
        next: None,
        children,
    }
}

/// How one child ended, as its parent learns it.
#[derive(Debug, Clone, PartialEq)]
pub struct ChildResult {
    pub run_id: RunId,
    pub parent_slot: u32,
    pub task_index: u32,
    pub agent: String,
    pub status: RunStatus,
    pub stop_reason: Option<StopReason>,
    pub answer: Option<String>,
}

impl ChildResult {
    /// How the child run `state` ended; None for a run that is not a child.
    pub fn of(state: &AgentState) -> Option<ChildResult> {
        let lineage = state.lineage.as_ref()?;
        Some(ChildResult {
            run_id: state.run_id.clone(),
            parent_slot: lineage.parent_slot,
            task_index: lineage.task_index,
            agent: lineage.agent.clone(),
            status: state.status,
            stop_reason: state.stop_reason,
            answer: state.final_answer.clone(),
        })
    }
}

/// What a child's start tells its parent: the `subagent.started` event, in the commit that
/// starts it.
fn child_started(parent: &RunId, child: &ChildRun) -> EventDraft {
    EventDraft::new(
        EventKind::SubagentStarted,
        json!({
            "run_id": parent,
            "child_run_id": child.run_id,
            "child_session_id": child.session_id,
            "call_id": child.call_id,
            "agent": child.lineage.agent,
            "task": child.task,
            "depth": child.lineage.depth,
            "background": child.lineage.background.is_some(),
        }),
    )
}

/// The step's background children start in its commit, which tells of each
/// (`subagent.started`) before its `step.committed`: a client following the parent learns of
/// every run below it from the parent's events.
pub fn start_in_background(result: &mut StepResult, children: Vec<ChildRun>) {
    let at = (result.events.iter())
        .position(|event| event.kind == EventKind::StepCommitted)
        .unwrap_or(result.events.len());
    let started: Vec<EventDraft> = (children.iter())
        .map(|child| child_started(&result.state.run_id, child))
        .collect();
    result.events.splice(at..at, started);
    result.children = children;
}

/// What a child's end tells its parent: the `subagent.finished` event.
pub fn child_finished(parent: &RunId, child: &ChildResult) -> EventDraft {
    EventDraft::new(
        EventKind::SubagentFinished,
        json!({
            "run_id": parent,
            "child_run_id": child.run_id,
            "agent": child.agent,
            "status": child.status,
            "stop_reason": child.stop_reason,
        }),
    )
}

/// Every child of the waiting step has ended: each delegating call gets one result per task,
/// in request order, and the run goes back to `running`; the returned job finishes the batch.
/// A child's failure is a result for the parent, not a failure of it.
pub fn join_children(
    state: &mut AgentState,
    mut results: Vec<ChildResult>,
) -> Result<(Vec<EventDraft>, StepJob), DecisionError> {
    if state.status != RunStatus::WaitingChildren {
        return Err(DecisionError::NotWaiting {
            run_id: state.run_id.clone(),
            status: state.status,
            expected: "its children".to_owned(),
        });
    }
    results.sort_by_key(|r| (r.parent_slot, r.task_index));
    if let Some(checkpoint) = state.checkpoint.as_mut() {
        for (slot, progress) in (0u32..).zip(checkpoint.calls.iter_mut()) {
            let of_call: Vec<Value> = results
                .iter()
                .filter(|r| r.parent_slot == slot)
                .map(result_json)
                .collect();
            if !of_call.is_empty() {
                let content = json!({"results": of_call}).to_string();
                progress.outcome = Some(ToolOutcome::ok(content));
            }
        }
    }
    let mut events = Vec::new();
    let job = back_to_running(state, Phase::ChildrenJoined, &mut events);
    Ok((events, job))
}

/// The outcome of a background `delegate` call: the runs it started, at once.
pub fn background_started(children: &[&ChildRun], policy: CompletionPolicy) -> ToolOutcome {
    let runs: Vec<Value> = children
        .iter()
        .map(|c| json!({"agent": c.lineage.agent, "run_id": c.run_id}))
        .collect();
    ToolOutcome::ok(
        json!({
            "mode": "background",
            "completion_policy": policy,
            "runs": runs,
            "note": "these runs go on in the background; their results will reach you in a later turn",
        })
        .to_string(),
    )
}

/// What a background completion reports: how each of its runs ended, in task order.
pub fn completion_report(parent: &RunId, mut results: Vec<ChildResult>) -> Value {
    results.sort_by_key(|r| (r.parent_slot, r.task_index));
    json!({
        "delegated_by": parent,
        "results": results.iter().map(result_json).collect::<Vec<_>>(),
    })
}

fn result_json(result: &ChildResult) -> Value {
    let mut entry = json!({
        "agent": result.agent,
        "run_id": result.run_id,
        "status": result.status,
    });
    match (result.status, result.stop_reason) {
        (RunStatus::Completed, _) => {
            entry["answer"] = json!(result.answer.clone().unwrap_or_default());
        }
        (_, Some(reason)) => {
            entry["error"] = json!(match reason {
                StopReason::Cancelled => "the run was cancelled".to_owned(),
                other => format!("the run failed: {other}"),
            });
        }
        (status, None) => entry["error"] = json!(format!("the run ended {status}")),
    }
    entry
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Limits, ToolCall, ToolCheckpoint};

    fn profile(id: &str) -> AgentProfile {
        AgentProfile {
            id: id.to_owned(),
            description: format!("the {id} agent"),
            config: RunConfigSnapshot::default(),
        }
    }

    fn delegation() -> DelegationConfig {
        DelegationConfig {
            agents: vec![profile("researcher"), profile("writer")],
            ..DelegationConfig::default()
        }
    }

    #[test]
    fn a_delegate_call_is_read_strictly_and_explains_what_is_wrong() {
        let ok = json!({"mode": "foreground", "tasks": [{"agent": "writer", "task": "draft", "context": "brief"}]});
        let request = parse_delegate(&ok, &delegation(), 0).unwrap();
        assert_eq!(request.tasks[0].message(), "draft\n\nContext:\nbrief");
        let refused = |arguments: Value, depth: u32, expected: &str| {
            let error = parse_delegate(&arguments, &delegation(), depth).unwrap_err();
            assert!(
                error.contains(expected),
                "{error:?} should say {expected:?}"
            );
        };
        refused(
            json!({"mode": "foreground", "tasks": []}),
            0,
            "1 to 64 tasks, found 0",
        );
        let many: Vec<Value> = (0..65)
            .map(|_| json!({"agent": "writer", "task": "x"}))
            .collect();
        refused(json!({"mode": "foreground", "tasks": many}), 0, "found 65");
        refused(
            json!({"mode": "foreground", "tasks": [{"agent": "boss", "task": "x"}]}),
            0,
            "unknown agent \"boss\"; this run may delegate to: researcher, writer",
        );
        refused(
            json!({"mode": "foreground", "tasks": [{"agent": "writer", "task": "  "}]}),
            0,
            "task 0: the task is empty",
        );
        refused(
            json!({"mode": "foreground", "tasks": [{"agent": "writer", "task": "x", "extra": 1}]}),
            0,
            "unknown field `extra`",
        );
        refused(json!({"tasks": []}), 0, "missing field `mode`");
        refused(
            json!({"mode": "foreground", "tasks": [{"agent": "writer", "task": "x"}]}),
            3,
            "limited to 3 levels",
        );
    }

    #[test]
    fn a_child_is_offered_only_the_delegatable_tools_its_definition_lists() {
        let tool = |name: &str, delegation| ToolSpec {
            calls: Default::default(),
            name: name.to_owned(),
            delegation,
            ..agent_task_tool()
        };
        let offered = vec![
            tool("read", ToolDelegation::Delegatable),
            tool("write", ToolDelegation::RootOnly),
            tool("search", ToolDelegation::Delegatable),
            tool("delegate", ToolDelegation::RuntimeInjected),
        ];
        let listed = ["read", "write", "delegate"].map(String::from).to_vec();
        let names: Vec<String> = child_tools(&offered, &listed)
            .into_iter()
            .map(|t| t.name)
            .collect();
        assert_eq!(names, ["read"]);
    }

    fn waiting_parent() -> AgentState {
        let mut state = AgentState::new(
            SessionId::from_suffix("p").unwrap(),
            RunId::from_suffix("p").unwrap(),
            RunConfigSnapshot {
                limits: Limits::default(),
                ..RunConfigSnapshot::default()
            },
            0,
        );
        let call = |id: &str, name: &str| ToolCall {
            id: id.into(),
            name: name.into(),
            arguments: json!({}),
        };
        let mut checkpoint = ToolCheckpoint::new(vec![
            call("a", "delegate"),
            call("b", "add"),
            call("c", "delegate"),
        ]);
        checkpoint.calls[1].outcome = Some(ToolOutcome::ok("3"));
        state.checkpoint = Some(checkpoint);
        state.status = RunStatus::WaitingChildren;
        state.step_index = 4;
        state
    }

    fn child(slot: u32, index: u32, status: RunStatus, reason: Option<StopReason>) -> ChildResult {
        ChildResult {
            run_id: RunId::from_suffix(&format!("c{slot}-{index}")).unwrap(),
            parent_slot: slot,
            task_index: index,
            agent: "writer".into(),
            status,
            stop_reason: reason,
            answer: (status == RunStatus::Completed).then(|| format!("answer {slot}.{index}")),
        }
    }

    #[test]
    fn the_join_hands_each_call_its_results_in_request_order_and_wakes_the_parent_once() {
        let mut state = waiting_parent();
        let results = vec![
            child(2, 0, RunStatus::Cancelled, Some(StopReason::Cancelled)),
            child(0, 1, RunStatus::Failed, Some(StopReason::BudgetExhausted)),
            child(0, 0, RunStatus::Completed, Some(StopReason::Completed)),
        ];
        let (events, job) = join_children(&mut state, results.clone()).unwrap();
        assert_eq!(state.status, RunStatus::Running);
        assert_eq!((job.step_index, job.phase), (5, Phase::ChildrenJoined));
        assert_eq!(events.len(), 1, "the status change");
        let outcome = |slot: usize| {
            let progress = &state.checkpoint.as_ref().unwrap().calls[slot];
            let outcome = progress.outcome.clone().unwrap();
            assert!(
                !outcome.is_error,
                "a child's failure is a result, not an error"
            );
            serde_json::from_str::<Value>(&outcome.content).unwrap()
        };
        assert_eq!(
            outcome(0)["results"],
            json!([
                {"agent": "writer", "run_id": "run_c0-0", "status": "completed", "answer": "answer 0.0"},
                {"agent": "writer", "run_id": "run_c0-1", "status": "failed", "error": "the run failed: budget_exhausted"},
            ])
        );
        assert_eq!(outcome(1), json!(3), "the other call keeps its own result");
        assert_eq!(outcome(2)["results"][0]["error"], "the run was cancelled");
        assert_eq!(
            crate::decide(&state, job.phase, 0),
            crate::Instruction::CallToolsBatch,
            "the batch is finished by a tools step, which hands the results over in order"
        );
        let again = join_children(&mut state, results).unwrap_err();
        assert!(
            matches!(again, DecisionError::NotWaiting { .. }),
            "a second join is refused"
        );
    }

    /// A parent about to take its step 4, and the child that step starts (in the background
    /// under `group`).
    fn parent_and_child(group: Option<BackgroundGroup>) -> (AgentState, StepJob, Vec<ChildRun>) {
        let mut state = waiting_parent();
        state.status = RunStatus::Running;
        state.step_index = 3;
        let job = StepJob {
            run_id: state.run_id.clone(),
            step_index: 4,
            phase: Phase::LlmResult,
            attempt: 1,
        };
        let lineage = Lineage {
            parent_run_id: state.run_id.clone(),
            parent_step: 4,
            parent_slot: 0,
            task_index: 0,
            root_run_id: state.run_id.clone(),
            root_session_id: state.session_id.clone(),
            depth: 1,
            agent: "writer".into(),
            background: group,
        };
        let children = vec![ChildRun {
            run_id: RunId::from_suffix("c").unwrap(),
            session_id: SessionId::from_suffix("c").unwrap(),
            message_id: MessageId::from_suffix("c").unwrap(),
            task: "draft".into(),
            call_id: "call_0".into(),
            config: RunConfigSnapshot::default(),
            lineage,
        }];
        (state, job, children)
    }

    #[test]
    fn a_tree_grows_within_its_limit_and_is_named_by_its_root() {
        let root = RunId::from_suffix("r").unwrap();
        assert_eq!(tree_has_room(&root, 3, 2, 5), Ok(()));
        assert_eq!(
            tree_has_room(&root, 3, 3, 5),
            Err("the run tree of run_r has 3 runs and may have at most 5".into())
        );
        let (state, _, children) = parent_and_child(None);
        assert_eq!(tree_root(&state), (&state.run_id, &state.session_id));
        let mut child = state.clone();
        child.lineage = Some(children[0].lineage.clone());
        assert_eq!(tree_root(&child), (&state.run_id, &state.session_id));
    }

    #[test]
    fn background_children_are_told_before_the_step_commits_and_not_at_all_after_a_cancel() {
        let (state, job, children) = parent_and_child(Some(BackgroundGroup::new(
            &RunId::from_suffix("p").unwrap(),
            4,
            0,
            CompletionPolicy::Each,
        )));
        let outcomes = vec![ToolOutcome::ok("started"); 3];
        let mut result = crate::step::after_tools(state, &job, outcomes, 0, 0, 1);
        start_in_background(&mut result, children);
        let kinds: Vec<EventKind> = result.events.iter().map(|e| e.kind).collect();
        let started = kinds.iter().position(|k| *k == EventKind::SubagentStarted);
        let committed = kinds.iter().position(|k| *k == EventKind::StepCommitted);
        assert!(
            started.is_some() && started < committed,
            "subagent.started, then step.committed: {kinds:?}"
        );
        let payload = &result.events[started.unwrap()].payload;
        assert_eq!(
            (
                &payload["child_session_id"],
                &payload["background"],
                &payload["depth"]
            ),
            (&json!("ses_c"), &json!(true), &json!(1))
        );
        assert_eq!(result.children.len(), 1);

        result.yield_to_cancel();
        assert!(result.children.is_empty());
        assert!(
            !result
                .events
                .iter()
                .any(|e| e.kind == EventKind::SubagentStarted),
            "a child that does not start is not told of: {:?}",
            result.events
        );
    }

    #[test]
    fn a_parent_that_yields_to_a_cancel_starts_no_children() {
        let (state, job, children) = parent_and_child(None);
        let mut result = await_children(state, &job, vec![None, None, None], children, 0, 1);
        assert_eq!(result.state.status, RunStatus::WaitingChildren);
        assert!(
            result
                .events
                .iter()
                .any(|e| e.kind == EventKind::SubagentStarted)
        );
        result.yield_to_cancel();
        assert_eq!(result.state.status, RunStatus::Cancelling);
        assert!(result.children.is_empty());
        assert!(
            !result
                .events
                .iter()
                .any(|e| e.kind == EventKind::SubagentStarted
                    || e.payload["status"] == "waiting_children"),
            "{:?}",
            result.events
        );
        assert_eq!(result.next.map(|j| j.phase), Some(Phase::Cancel));
    }
}
