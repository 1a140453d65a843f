//! `ratchet runs list` and `ratchet runs show`.

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use ratchet_core::step::Reconciliation;
use ratchet_core::{HumanRequest, RunId};
use ratchet_store::TreeNode;
use serde_json::json;

use ratchet::open_existing_store;

pub async fn list(db: &str, json: bool) -> anyhow::Result<ExitCode> {
    let runs = open_existing_store(db)?.list_runs().await?;
    let mut out = std::io::stdout().lock();
    if json {
        writeln!(out, "{}", serde_json::to_string(&runs)?)?;
    } else {
        writeln!(
            out,
            "{:<38} {:<38} {:<16} {:<17} {:>5}",
            "RUN", "SESSION", "STATUS", "STOP REASON", "STEPS"
        )?;
        for run in runs {
            let reason = run.stop_reason.map_or("-".to_owned(), |r| r.to_string());
            writeln!(
                out,
                "{:<38} {:<38} {:<16} {:<17} {:>5}",
                run.run_id, run.session_id, run.status, reason, run.step_index
            )?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn show(db: &str, run_id: &str, json: bool) -> anyhow::Result<ExitCode> {
    let run_id = RunId::parse(run_id)?;
    let store = open_existing_store(db)?;
    let state = store
        .load_state(&run_id)
        .await
        .with_context(|| format!("cannot show run {run_id}"))?;
    let steps = store.steps(&run_id).await?;
    let tree = store.run_tree(&run_id).await?;
    let mut out = std::io::stdout().lock();
    if json {
        let body = json!({
            "run_id": state.run_id,
            "session_id": state.session_id,
            "status": state.status,
            "stop_reason": state.stop_reason,
            "step_index": state.step_index,
            "counters": state.counters,
            "final_answer": state.final_answer,
            "pending_human": state.pending_human,
            "in_doubt": state.in_doubt,
            "forked_from": state.forked_from,
            "steps": steps.iter().map(|s| json!({
                "index": s.index,
                "instruction": s.instruction,
                "duration_ms": s.finished_at - s.started_at,
                "summary": s.summary,
            })).collect::<Vec<_>>(),
            "tree": tree,
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&body)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    let reason = state.stop_reason.map_or("-".to_owned(), |r| r.to_string());
    writeln!(out, "run          {}", state.run_id)?;
    writeln!(out, "session      {}", state.session_id)?;
    writeln!(out, "status       {} (stop reason: {reason})", state.status)?;
    writeln!(out, "step_index   {}", state.step_index)?;
    writeln!(out, "model        {}", state.config.model)?;
    if let Some(from) = &state.forked_from {
        writeln!(out, "forked from  {} at step {}", from.run_id, from.step)?;
    }
    if let Some(HumanRequest::Reconciliation { calls }) = &state.pending_human {
        writeln!(
            out,
            "waiting for  a human to reconcile calls whose outcome is unknown (or whose tool changed):"
        )?;
        write_calls_in_doubt(&mut out, calls)?;
    }
    if !state.in_doubt.is_empty() {
        writeln!(
            out,
            "in doubt     calls cut off when the run ended; record what happened with `ratchet runs reconcile`:"
        )?;
        write_calls_in_doubt(&mut out, &state.in_doubt)?;
    }
    if let Some(HumanRequest::Approval { approval_id, calls }) = &state.pending_human {
        writeln!(
            out,
            "waiting for  approval {approval_id} (`ratchet approvals decide {approval_id}`):"
        )?;
        for call in calls {
            let gated = if call.needs_approval {
                " (needs approval)"
            } else {
                ""
            };
            writeln!(
                out,
                "  {}: {} {}{gated}",
                call.call_id, call.tool, call.arguments
            )?;
        }
    }
    writeln!(out, "steps")?;
    for step in steps {
        writeln!(
            out,
            "  {:>4}  {:<17} {:>6} ms  {}",
            step.index,
            step.instruction,
            step.finished_at - step.started_at,
            step.summary
        )?;
    }
    let answer = state
        .final_answer
        .filter(|a| state.status.is_terminal() && !a.is_empty());
    if let Some(answer) = answer {
        writeln!(out, "answer       {answer}")?;
    }
    if tree.len() > 1 {
        writeln!(out, "tree:")?;
        for line in draw_tree(&tree) {
            writeln!(out, "{line}")?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The lines of a run tree as `Reads::run_tree` lists it (its first node at the top, parents
/// before their children): each run below its parent, joined by box-drawing branches.
fn draw_tree(nodes: &[TreeNode]) -> Vec<String> {
    let Some(top) = nodes.first() else {
        return Vec::new();
    };
    let mut lines = vec![describe(top)];
    draw_children(nodes, top, "", &mut lines);
    lines
}

fn draw_children(nodes: &[TreeNode], parent: &TreeNode, indent: &str, lines: &mut Vec<String>) {
    let children: Vec<&TreeNode> = nodes
        .iter()
        .filter(|n| n.parent_run_id.as_ref() == Some(&parent.run_id))
        .collect();
    for (i, child) in children.iter().enumerate() {
        let last = i + 1 == children.len();
        let (branch, below) = if last {
            ("└─ ", "   ")
        } else {
            ("├─ ", "│  ")
        };
        lines.push(format!("{indent}{branch}{}", describe(child)));
        draw_children(nodes, child, &format!("{indent}{below}"), lines);
    }
}

/// `run_…  AGENT  [background]  STATUS (STOP REASON)  N steps`, the agent and a stop reason
/// that only repeats the status left out.
fn describe(node: &TreeNode) -> String {
    let mut parts = vec![node.run_id.to_string()];
    parts.extend(node.agent.clone());
    if node.background {
        parts.push("background".to_owned());
    }
    let status = node.status.as_str();
    parts.push(match node.stop_reason.map(|r| r.as_str()) {
        Some(reason) if reason != status => format!("{status} ({reason})"),
        _ => status.to_owned(),
    });
    let plural = if node.step_index == 1 { "" } else { "s" };
    parts.push(format!("{} step{plural}", node.step_index));
    parts.join("  ")
}

/// A human's answer about a call in doubt, as the command line spells it.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Outcome {
    Succeeded,
    Failed,
    Retry,
    Skip,
}

pub async fn reconcile(
    db: &str,
    run_id: &str,
    call_id: &str,
    outcome: Outcome,
    result: Option<String>,
) -> anyhow::Result<ExitCode> {
    let run_id = RunId::parse(run_id)?;
    let answer = match outcome {
        Outcome::Succeeded => Reconciliation::Succeeded,
        Outcome::Failed => Reconciliation::Failed,
        Outcome::Retry => Reconciliation::Retry,
        Outcome::Skip => Reconciliation::Skip,
    };
    let store = open_existing_store(db)?;
    let coordinator = ratchet_engine::Coordinator::new(store);
    let reconciled = coordinator
        .reconcile(&run_id, call_id, answer, result)
        .await
        .with_context(|| format!("cannot reconcile call {call_id} of run {run_id}"))?;
    let mut out = std::io::stdout().lock();
    if reconciled.resumed {
        writeln!(
            out,
            "every call of {run_id} is reconciled; `ratchet resume` carries the run on"
        )?;
    } else {
        writeln!(
            out,
            "recorded; {run_id} still waits for other calls (see `ratchet runs show {run_id}`)"
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `runs retry` and `runs continue`: the failed run is running again, its next step enqueued.
pub async fn resume_failed(
    db: &str,
    run_id: &str,
    how: ratchet_core::step::Resumption,
) -> anyhow::Result<ExitCode> {
    let run_id = RunId::parse(run_id)?;
    let coordinator = ratchet_engine::Coordinator::new(open_existing_store(db)?);
    coordinator
        .resume_failed(&run_id, how, None)
        .await
        .with_context(|| format!("cannot resume run {run_id}"))?;
    writeln!(
        std::io::stdout(),
        "{run_id} is running again; `ratchet resume` carries it on"
    )?;
    Ok(ExitCode::SUCCESS)
}

fn write_calls_in_doubt(
    out: &mut impl Write,
    calls: &[ratchet_core::UnknownCall],
) -> std::io::Result<()> {
    for call in calls {
        writeln!(
            out,
            "  call #{} {}: {} {} (idempotency key {})",
            call.call_index, call.call_id, call.tool, call.arguments, call.idempotency_key
        )?;
        if let Some(drift) = &call.drift {
            writeln!(out, "    {drift}")?;
        }
    }
    Ok(())
}
