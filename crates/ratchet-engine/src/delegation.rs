//! The engine's side of sub-agents: turning a batch's `delegate` calls into child runs
//! (admitted against the tree's limits and the run quota), and the `agent_task` tool a run
//! looks after the runs below it with.
//!
//! Nothing here writes: children are created by the commit of the step that asked for them,
//! so a step redone after a crash creates none twice.

use std::sync::Arc;

use async_trait::async_trait;
use ratchet_core::delegation::{
    BackgroundGroup, ChildRun, DelegateRequest, DelegationMode, parse_delegate,
};
use ratchet_core::inbox::SignalContract;
use ratchet_core::inbox::{emit_signal_tool, parse_signal};
use ratchet_core::{
    AgentState, CompletionPolicy, Instruction, Lineage, MessageId, ReplayPolicy, RunId, RunStatus,
    SessionId, StepJob, ToolOutcome,
};
use ratchet_store::{Claim, NewSignal, RunQuota, SignalOutcome, TreeNode};
use ratchet_tools::{Tool, ToolContext};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::Coordinator;
use crate::coordinator::fresh_suffix;

/// A `delegate` call of the batch that passed its checks, at its slot.
pub(crate) struct Delegation {
    pub slot: u32,
    pub call_id: String,
    pub request: DelegateRequest,
}

/// Reads a `delegate` call; the error is the call's outcome, shown to the model.
pub(crate) fn read_delegate(
    state: &AgentState,
    arguments: &Value,
) -> Result<DelegateRequest, String> {
    let depth = state.lineage.as_ref().map_or(0, |l| l.depth);
    parse_delegate(arguments, &state.config.delegation, depth)
}

/// Checks that the batch's delegations fit the tree's size limit, the run quota and — for
/// background ones — the root session's inbox. The commit checks all three again, exactly,
/// under the locks that make them hold; a step refused there is redone, and this check, which
/// then counts what the other commit added, is what tells the model instead of failing the
/// commit again.
pub(crate) async fn admit(
    coordinator: &Coordinator,
    state: &AgentState,
    delegations: &[Delegation],
) -> crate::Result<Result<(), String>> {
    let admission = coordinator.store().admission(&state.run_id).await?;
    let adding: u64 = delegations
        .iter()
        .map(|d| d.request.tasks.len() as u64)
        .sum();
    let places: u64 = delegations
        .iter()
        .map(|d| match (d.request.mode, d.request.completion_policy) {
            (DelegationMode::Foreground, _) => 0,
            (DelegationMode::Background, Some(CompletionPolicy::Each)) => {
                d.request.tasks.len() as u64
            }
            (DelegationMode::Background, _) => 1,
        })
        .sum();
    let inbox = state.config.delegation.inbox.capacity;
    if places > 0 && admission.inbox_held + places > u64::from(inbox) {
        return Ok(Err(format!(
            "the session's inbox holds {} reports and reservations and may hold {inbox}; background work needing {places} more cannot start — wait for earlier background work to report back, or delegate in the foreground",
            admission.inbox_held
        )));
    }
    let tree_limit = state.config.delegation.max_tree_runs;
    if admission.tree_runs + adding > tree_limit {
        return Ok(Err(format!(
            "this run tree already has {} runs and may have at most {tree_limit}; {adding} more do not fit — do the work yourself or delegate fewer tasks",
            admission.tree_runs
        )));
    }
    let RunQuota {
        global,
        per_session,
    } = coordinator.quota();
    if let Some(max) = per_session.filter(|&max| admission.active_in_session + adding > max) {
        return Ok(Err(format!(
            "the session may have at most {max} unfinished runs and has {}; delegate fewer tasks or do the work yourself",
            admission.active_in_session
        )));
    }
    if let Some(max) = global.filter(|&max| admission.active_global + adding > max) {
        return Ok(Err(format!(
            "the runtime may have at most {max} unfinished runs and has {}; delegate fewer tasks or do the work yourself",
            admission.active_global
        )));
    }
    Ok(Ok(()))
}

/// The Brain's instruction, admitted against the budget the run's whole tree shares: a model
/// call with tools concludes once the tree's runs have spent it (`TreeBudget::admit`). The
/// spend is read from the store only when there is a budget and a call it could change.
pub(crate) async fn within_tree_budget(
    coordinator: &Coordinator,
    state: &AgentState,
    instruction: Instruction,
) -> ratchet_store::Result<Instruction> {
    let budget = state.config.delegation.tree_budget;
    if !budget.is_limited() || instruction != (Instruction::CallLlm { conclude: false }) {
        return Ok(instruction);
    }
    let spend = coordinator.store().tree_spend(&state.run_id).await?;
    let admitted = budget.admit(instruction, spend);
    if admitted != instruction {
        tracing::info!(run = %state.run_id, ?spend, "the tree has spent its budget; this model call concludes");
    }
    Ok(admitted)
}

/// The child runs of the batch's delegations, in call order and task order. Each starts from
/// its agent's frozen configuration, under the tree's limits (the root's).
pub(crate) fn children(
    state: &AgentState,
    job: &StepJob,
    delegations: &[Delegation],
) -> Result<Vec<ChildRun>, ratchet_core::IdError> {
    let parent = &state.config.delegation;
    let (root_run_id, root_session_id, depth) = match &state.lineage {
        Some(l) => (l.root_run_id.clone(), l.root_session_id.clone(), l.depth),
        None => (state.run_id.clone(), state.session_id.clone(), 0),
    };
    let mut children = Vec::new();
    for delegation in delegations {
        for (index, task) in (0u32..).zip(&delegation.request.tasks) {
            let Some(profile) = parent.agent(&task.agent) else {
                continue;
            };
            let mut config = profile.config.clone();
            config.delegation.max_depth = parent.max_depth;
            config.delegation.max_tree_runs = parent.max_tree_runs;
            config.delegation.tree_budget = parent.tree_budget;
            let background = delegation.request.mode == DelegationMode::Background;
            // Only a background run may report before it ends, and only under its contract.
            match (&config.signal, background) {
                (Some(contract), true) => config.tools.push(emit_signal_tool(contract)),
                _ => config.signal = None,
            }
            let suffix = fresh_suffix();
            children.push(ChildRun {
                run_id: RunId::from_suffix(&suffix)?,
                session_id: SessionId::from_suffix(&suffix)?,
                message_id: MessageId::from_suffix(&suffix)?,
                task: task.message(),
                call_id: delegation.call_id.clone(),
                config,
                lineage: Lineage {
                    parent_run_id: state.run_id.clone(),
                    parent_step: job.step_index,
                    parent_slot: delegation.slot,
                    task_index: index,
                    root_run_id: root_run_id.clone(),
                    root_session_id: root_session_id.clone(),
                    depth: depth + 1,
                    agent: task.agent.clone(),
                    background: background.then(|| {
                        BackgroundGroup::new(
                            &state.run_id,
                            job.step_index,
                            delegation.slot,
                            delegation.request.completion_policy.unwrap_or_default(),
                        )
                    }),
                },
            });
        }
    }
    Ok(children)
}

/// `agent_task`: get, list, get_result or cancel the runs below the caller in its tree —
/// never the caller itself, its ancestors or another tree. A continuation turn's reads the
/// runs that report to its session instead (`TaskScope::Reports`).
pub(crate) struct AgentTask {
    pub coordinator: Arc<Coordinator>,
    pub caller: RunId,
    pub scope: TaskScope,
    /// The most bytes of an answer one `get_result` returns.
    pub page_bytes: u64,
}

/// Which runs an `agent_task` reaches.
pub(crate) enum TaskScope {
    /// The runs below the caller in its tree: every action.
    Below,
    /// Any run started from the trees of this root session (the runs its inbox reports
    /// about), read only: `get` and `get_result`.
    Reports(SessionId),
}

impl AgentTask {
    pub(crate) fn for_run(coordinator: Arc<Coordinator>, state: &AgentState) -> AgentTask {
        let scope = if state.config.continuation {
            TaskScope::Reports(state.session_id.clone())
        } else {
            TaskScope::Below
        };
        AgentTask {
            coordinator,
            caller: state.run_id.clone(),
            scope,
            page_bytes: answer_page_bytes(state.config.limits.max_tool_result_bytes),
        }
    }
}

/// What one page of an answer may hold so that the tool result carrying it (escaped as JSON,
/// which may double it, with the run's description) fits in `max_tool_result_bytes` and is
/// never cut again on its way to the model.
fn answer_page_bytes(max_tool_result_bytes: u64) -> u64 {
    (max_tool_result_bytes / 2).saturating_sub(512).max(256)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AgentTaskRequest {
    action: Action,
    #[serde(default)]
    run_id: Option<String>,
    /// Where in the answer a `get_result` page starts, in bytes.
    #[serde(default)]
    offset: u64,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum Action {
    List,
    Get,
    GetResult,
    Cancel,
}

#[async_trait]
impl Tool for AgentTask {
    fn name(&self) -> &str {
        ratchet_core::delegation::AGENT_TASK_TOOL
    }

    fn description(&self) -> &str {
        "looks after the runs below the caller"
    }

    fn parameters(&self) -> Value {
        ratchet_core::delegation::agent_task_tool().parameters
    }

    fn replay(&self) -> ReplayPolicy {
        ReplayPolicy::Safe
    }

    async fn call(&self, arguments: Value, _context: &ToolContext) -> ToolOutcome {
        let request: AgentTaskRequest = match serde_json::from_value(arguments) {
            Ok(request) => request,
            Err(e) => {
                return ToolOutcome::error(format!(
                    "invalid agent_task arguments: {e}; expected {{\"action\": \"list\" | \"get\" | \"get_result\" | \"cancel\", \"run_id\": ID, \"offset\": BYTES}}"
                ));
            }
        };
        match self.answer(request).await {
            Ok(outcome) => outcome,
            Err(error) => ToolOutcome::error(format!("agent_task failed: {error}")),
        }
    }
}

impl AgentTask {
    async fn answer(&self, request: AgentTaskRequest) -> crate::Result<ToolOutcome> {
        let store = self.coordinator.store();
        let node = match (&self.scope, request.action) {
            (TaskScope::Reports(_), Action::List | Action::Cancel) => {
                return Ok(ToolOutcome::error(
                    "a report's turn may only `get` a run or `get_result` its answer",
                ));
            }
            (TaskScope::Reports(session), Action::Get | Action::GetResult) => {
                match self.reported(session, request.run_id).await? {
                    Ok(node) => node,
                    Err(refusal) => return Ok(refusal),
                }
            }
            (TaskScope::Below, action) => {
                let tree = store.run_tree(&self.caller).await?;
                let below: Vec<&TreeNode> =
                    tree.iter().filter(|n| n.run_id != self.caller).collect();
                if action == Action::List {
                    let runs: Vec<Value> = below.iter().map(|n| node_json(n)).collect();
                    return Ok(ToolOutcome::ok(json!({"runs": runs}).to_string()));
                }
                match pick(&below, request.run_id) {
                    Ok(node) => node.clone(),
                    Err(refusal) => return Ok(refusal),
                }
            }
        };
        let node = &node;
        match request.action {
            Action::List | Action::Get => Ok(ToolOutcome::ok(node_json(node).to_string())),
            Action::GetResult => {
                if !node.status.is_terminal() {
                    return Ok(ToolOutcome::error(format!(
                        "run {} has not ended (it is {}); ask again later",
                        node.run_id, node.status
                    )));
                }
                let state = store.load_state(&node.run_id).await?;
                let answer = state.final_answer.unwrap_or_default();
                let page = match answer_page(&answer, request.offset, self.page_bytes) {
                    Ok(page) => page,
                    Err(refusal) => return Ok(ToolOutcome::error(refusal)),
                };
                let mut result = node_json(node);
                result["answer"] = json!(page.text);
                result["answer_bytes"] = json!(answer.len());
                result["offset"] = json!(request.offset);
                result["next_offset"] = json!(page.next_offset);
                Ok(ToolOutcome::ok(result.to_string()))
            }
            Action::Cancel => {
                let outcome = self.coordinator.request_cancel(&node.run_id).await?;
                let status = match outcome {
                    ratchet_store::CancelOutcome::Cancelled { .. } => RunStatus::Cancelled,
                    ratchet_store::CancelOutcome::Cancelling { .. } => RunStatus::Cancelling,
                    ratchet_store::CancelOutcome::AlreadyTerminal(status) => status,
                };
                Ok(ToolOutcome::ok(
                    json!({"run_id": node.run_id, "status": status}).to_string(),
                ))
            }
        }
    }

    /// The run `wanted` names if it was started from `session`'s trees (and is not the
    /// caller), or the refusal the model reads.
    async fn reported(
        &self,
        session: &SessionId,
        wanted: Option<String>,
    ) -> crate::Result<Result<TreeNode, ToolOutcome>> {
        let Some(wanted) = wanted else {
            return Ok(Err(ToolOutcome::error(
                "this action needs \"run_id\": a run a report names",
            )));
        };
        let refusal = || {
            ToolOutcome::error(format!(
                "run {wanted:?} did not report to this session; only the runs the reports name can be read"
            ))
        };
        let Ok(run_id) = RunId::parse(&wanted) else {
            return Ok(Err(refusal()));
        };
        let store = self.coordinator.store();
        let state = match store.load_state(&run_id).await {
            Ok(state) => state,
            Err(ratchet_store::Error::NotFound { .. }) => return Ok(Err(refusal())),
            Err(error) => return Err(error.into()),
        };
        if run_id == self.caller || ratchet_core::delegation::tree_root(&state).1 != session {
            return Ok(Err(refusal()));
        }
        let tree = store.run_tree(&run_id).await?;
        Ok(tree
            .into_iter()
            .find(|n| n.run_id == run_id)
            .ok_or_else(refusal))
    }
}

/// One page of an answer.
#[derive(Debug, PartialEq)]
struct AnswerPage<'a> {
    text: &'a str,
    /// Where the next page starts; None on the last.
    next_offset: Option<usize>,
}

/// The page of `answer` that starts at byte `offset` and holds at most `page_bytes` (ending on
/// a character boundary), or what is wrong with `offset`.
fn answer_page(answer: &str, offset: u64, page_bytes: u64) -> Result<AnswerPage<'_>, String> {
    let start = usize::try_from(offset).unwrap_or(usize::MAX);
    if start > answer.len() || !answer.is_char_boundary(start) {
        return Err(format!(
            "offset {offset} is not where a page of this {}-byte answer starts; pass 0 or a next_offset it gave",
            answer.len()
        ));
    }
    let page = usize::try_from(page_bytes).unwrap_or(usize::MAX);
    let mut end = start.saturating_add(page).min(answer.len());
    while !answer.is_char_boundary(end) {
        end -= 1;
    }
    Ok(AnswerPage {
        text: &answer[start..end],
        next_offset: (end < answer.len()).then_some(end),
    })
}

/// The run `wanted` names among those below the caller, or the refusal the model reads.
fn pick<'a>(below: &[&'a TreeNode], wanted: Option<String>) -> Result<&'a TreeNode, ToolOutcome> {
    let Some(wanted) = wanted else {
        return Err(ToolOutcome::error(
            "this action needs \"run_id\": one of the runs `list` shows",
        ));
    };
    below
        .iter()
        .find(|n| n.run_id.as_str() == wanted)
        .copied()
        .ok_or_else(|| {
            ToolOutcome::error(format!(
                "run {wanted:?} is not below this run in its tree; only runs you (or your delegates) started can be reached"
            ))
        })
}

fn node_json(node: &TreeNode) -> Value {
    json!({
        "run_id": node.run_id,
        "agent": node.agent,
        "parent_run_id": node.parent_run_id,
        "depth": node.depth,
        "status": node.status,
        "stop_reason": node.stop_reason,
        "steps": node.step_index,
    })
}

/// `emit_signal`: a background run tells its root session something before it ends, under its
/// signal contract; the store keeps one signal per call, so a redone step sends nothing twice.
pub(crate) struct EmitSignal {
    pub coordinator: Arc<Coordinator>,
    pub claim: Claim,
    pub contract: SignalContract,
    pub agent: Option<String>,
}

#[async_trait]
impl Tool for EmitSignal {
    fn name(&self) -> &str {
        ratchet_core::delegation::EMIT_SIGNAL_TOOL
    }

    fn description(&self) -> &str {
        "sends a signal to the root session"
    }

    fn parameters(&self) -> Value {
        emit_signal_tool(&self.contract).parameters
    }

    fn replay(&self) -> ReplayPolicy {
        ReplayPolicy::Safe
    }

    async fn call(&self, arguments: Value, context: &ToolContext) -> ToolOutcome {
        let request = match parse_signal(&arguments, &self.contract) {
            Ok(request) => request,
            Err(refusal) => return ToolOutcome::error(refusal),
        };
        let signal = NewSignal {
            call_key: context.idempotency_key.clone(),
            dedupe_key: request.dedupe_key().to_owned(),
            payload: json!({
                "from_run_id": self.claim.run_id,
                "agent": self.agent,
                "severity": request.severity,
                "summary": request.summary,
                "details": request.details,
            }),
        };
        match self.coordinator.emit_signal(&self.claim, signal).await {
            Ok(SignalOutcome::Sent(event)) => {
                ToolOutcome::ok(json!({"sent": true, "event": event}).to_string())
            }
            Ok(SignalOutcome::Duplicate(event)) => ToolOutcome::ok(
                json!({"sent": false, "event": event, "note": "the same signal was sent recently; it stands for this one"})
                    .to_string(),
            ),
            Ok(SignalOutcome::Refused(why)) => ToolOutcome::error(why),
            Err(error) => ToolOutcome::error(format!("emit_signal failed: {error}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_read_in_pages_that_end_on_characters_and_join_up_whole() {
        let answer = "é".repeat(1_000) + "the end";
        let mut offset = 0;
        let mut read = String::new();
        loop {
            let page = answer_page(&answer, offset, 301).unwrap();
            assert!(page.text.len() <= 301);
            read.push_str(page.text);
            match page.next_offset {
                Some(next) => offset = next as u64,
                None => break,
            }
        }
        assert_eq!(read, answer);
        assert_eq!(answer_page("short", 0, 301).unwrap().next_offset, None);
        assert_eq!(answer_page("", 0, 301).unwrap().text, "");
        for wrong in [1, 2_008, u64::MAX] {
            let refused = answer_page(&answer, wrong, 301).unwrap_err();
            assert!(refused.contains("pass 0 or a next_offset"), "{refused}");
        }
    }

    #[test]
    fn a_page_and_its_escapes_fit_in_one_tool_result() {
        for max in [1_024, 8_192, 65_536] {
            let page = answer_page_bytes(max);
            assert!(
                page >= 256 && 2 * page + 512 <= max.max(1_024),
                "{max}: {page}"
            );
        }
    }
}
