//! Delegation: the child runs a parent's step created, started in its commit (all of them or
//! none, within the tree's size and the run quota); the children's results for the join; the
//! run tree; what admission reads; and a tree's spend.

use ratchet_core::delegation::{ChildResult, ChildRun, tree_has_room, tree_root};
use ratchet_core::{AgentState, Millis, RunId, StopReason, TraceContext, TreeSpend};
use ratchet_store::{Admission, Error, StoredEvent, TreeNode, subtree};

use crate::db::Db;
use crate::events::insert_events;
use crate::queue::{
    ACTIVE_STATUSES, active_in_session, check_quota, insert_queued_run, start_queued_run,
};
use crate::rows::{
    count, from_json, parse_run_id, parse_session_id, parse_status, run_not_found, sql_enum,
};
use crate::runs::load_state;
use crate::{Result, params};

/// Runs of the tree whose root run is `root`, ended ones included.
fn tree_runs(c: &dyn Db, root: &RunId) -> Result<u64> {
    count(
        c,
        "SELECT count(*) FROM runs WHERE id = ?1 OR root_run_id = ?1",
        &params![root.as_str()],
    )
}

/// Starts the children a parent's step created, each the active run of a new session below
/// the parent's, with its task as its first message and its first job enqueued — all of them,
/// or none when the tree's size or the run quota has no room for them all.
pub(crate) fn start_children(
    c: &dyn Db,
    parent: &AgentState,
    children: &[ChildRun],
    quota: ratchet_store::RunQuota,
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    let (root, root_session) = tree_root(parent);
    let limit = parent.config.delegation.max_tree_runs;
    tree_has_room(root, tree_runs(c, root)?, children.len() as u64, limit)
        .map_err(Error::QuotaExceeded)?;
    check_quota(c, root_session, quota, children.len() as u64)?;
    let tenant = c
        .query_opt(
            "SELECT tenant FROM sessions WHERE id = ?1",
            &params![parent.session_id.as_str()],
        )?
        .ok_or_else(|| Error::NotFound {
            kind: "session",
            id: parent.session_id.to_string(),
        })?
        .text(0)?;
    let mut events = crate::inbox::reserve(c, parent, children, now)?;
    for child in children {
        let lineage = &child.lineage;
        c.execute(
            "INSERT INTO sessions (id, created_at, tenant, agent, parent_session_id, root_session_id)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            &params![
                child.session_id.as_str(),
                now,
                &tenant,
                &lineage.agent,
                parent.session_id.as_str(),
                lineage.root_session_id.as_str()
            ],
        )?;
        let (mut state, created) = insert_queued_run(
            c,
            &child.session_id,
            &child.run_id,
            child.message_id.as_str(),
            &child.task,
            child.config.clone(),
            Some(TraceContext::of_child(
                parent,
                lineage.parent_step,
                lineage.parent_slot,
            )),
            now,
        )?;
        c.execute(
            "UPDATE runs SET parent_run_id = ?2, parent_step = ?3, parent_slot = ?4, task_index = ?5,
                             root_run_id = ?6, agent = ?7, depth = ?8, inbox_group = ?9
             WHERE id = ?1",
            &params![
                child.run_id.as_str(),
                lineage.parent_run_id.as_str(),
                lineage.parent_step as i64,
                lineage.parent_slot,
                lineage.task_index,
                lineage.root_run_id.as_str(),
                &lineage.agent,
                lineage.depth,
                lineage.background.as_ref().map(|b| b.group.as_str())
            ],
        )?;
        state.lineage = Some(lineage.clone());
        let mut drafts = vec![created];
        drafts.extend(start_queued_run(c, state, now)?);
        events.extend(insert_events(
            c,
            &child.session_id,
            Some(&child.run_id),
            &drafts,
            now,
        )?);
    }
    Ok(events)
}

/// How every child of a parent's step ended, read from their states.
pub(crate) fn children_results(c: &dyn Db, parent: &RunId, step: u64) -> Result<Vec<ChildResult>> {
    let ids = c
        .query(
            "SELECT id FROM runs WHERE parent_run_id = ?1 AND parent_step = ?2 AND inbox_group IS NULL",
            &params![parent.as_str(), step as i64],
        )?
        .into_iter()
        .map(|mut r| parse_run_id(&r.text(0)?))
        .collect::<Result<Vec<_>>>()?;
    ids.iter()
        .map(|id| {
            ChildResult::of(&load_state(c, id)?)
                .ok_or_else(|| Error::Corrupt(format!("child run {id} has no lineage")))
        })
        .collect()
}

/// The part of a stored state a run's spend is read from.
#[derive(serde::Deserialize)]
struct Spent {
    counters: ratchet_core::Counters,
}

pub(crate) fn run_tree(c: &dyn Db, run_id: &RunId) -> Result<Vec<TreeNode>> {
    let root = c
        .query_opt(
            "SELECT COALESCE(root_run_id, id) FROM runs WHERE id = ?1",
            &params![run_id.as_str()],
        )?
        .ok_or_else(|| run_not_found(run_id))?
        .text(0)?;
    let nodes = c
        .query(
            "SELECT id, session_id, parent_run_id, agent, depth, status, stop_reason, step_index, created_at, finished_at, inbox_group IS NOT NULL, state_json
             FROM runs WHERE id = ?1 OR root_run_id = ?1 ORDER BY depth, created_at, id",
            &params![&root],
        )?
        .into_iter()
        .map(|mut r| {
            Ok(TreeNode {
                run_id: parse_run_id(&r.text(0)?)?,
                session_id: parse_session_id(&r.text(1)?)?,
                parent_run_id: r.opt_text(2)?.as_deref().map(parse_run_id).transpose()?,
                agent: r.opt_text(3)?,
                depth: u32::try_from(r.int(4)?)
                    .map_err(|_| Error::Corrupt("a run's depth is out of range".into()))?,
                status: parse_status(&r.text(5)?)?,
                stop_reason: r
                    .opt_text(6)?
                    .map(|reason| sql_enum::<StopReason>(&reason))
                    .transpose()?,
                step_index: r.int(7)? as u64,
                created_at: r.int(8)?,
                finished_at: r.opt_int(9)?,
                background: r.flag(10)?,
                counters: from_json::<Spent>(&r.text(11)?, "run state")?.counters,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(subtree(nodes, run_id))
}

pub(crate) fn admission(c: &dyn Db, run_id: &RunId) -> Result<Admission> {
    let mut row = c
        .query_opt(
            "SELECT COALESCE(r.root_run_id, r.id), COALESCE(s.root_session_id, s.id)
             FROM runs r JOIN sessions s ON s.id = r.session_id WHERE r.id = ?1",
            &params![run_id.as_str()],
        )?
        .ok_or_else(|| run_not_found(run_id))?;
    let root_run = parse_run_id(&row.text(0)?)?;
    let root_session = parse_session_id(&row.text(1)?)?;
    Ok(Admission {
        active_global: count(
            c,
            &format!("SELECT count(*) FROM runs WHERE status IN {ACTIVE_STATUSES}"),
            &[],
        )?,
        active_in_session: active_in_session(c, &root_session)?,
        tree_runs: tree_runs(c, &root_run)?,
        inbox_held: crate::inbox::held(c, &root_session)?,
    })
}

pub(crate) fn tree_spend(c: &dyn Db, run_id: &RunId) -> Result<TreeSpend> {
    let root = c
        .query_opt(
            "SELECT COALESCE(root_run_id, id) FROM runs WHERE id = ?1",
            &params![run_id.as_str()],
        )?
        .ok_or_else(|| run_not_found(run_id))?
        .text(0)?;
    let mut spend = TreeSpend::default();
    for mut row in c.query(
        "SELECT state_json FROM runs WHERE id = ?1 OR root_run_id = ?1",
        &params![&root],
    )? {
        spend = spend.with_run(&from_json::<Spent>(&row.text(0)?, "run state")?.counters);
    }
    Ok(spend)
}

/// The runs a parent's foreground delegations started that have not ended, oldest first (a
/// background run belongs to the root session, not to its parent).
pub(crate) fn unfinished_foreground_children(c: &dyn Db, parent: &RunId) -> Result<Vec<RunId>> {
    c.query(
        &format!(
            "SELECT id FROM runs WHERE parent_run_id = ?1 AND inbox_group IS NULL AND status IN {ACTIVE_STATUSES} ORDER BY created_at, id"
        ),
        &params![parent.as_str()],
    )?
    .into_iter()
    .map(|mut r| parse_run_id(&r.text(0)?))
    .collect()
}
