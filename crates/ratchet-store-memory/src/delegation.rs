//! Delegation: a parent's step starts child runs, each the active run of a new session below
//! the parent's, all of them or none within the tree's size and the run quotas; trees are
//! read whole, counted and costed.

use ratchet_core::delegation::{ChildResult, ChildRun, tree_has_room, tree_root};
use ratchet_core::{AgentState, Millis, RunId, SessionId, TraceContext, TreeSpend};
use ratchet_store::{Admission, Error, Result, RunQuota, StoredEvent, TreeNode, subtree};

use crate::tables::{RunRow, SessionRow, Tables, duplicate};

impl Tables {
    /// Unfinished runs in the whole store.
    fn active_global(&self) -> u64 {
        count(self.runs.values().filter(|run| !run.status().is_terminal()))
    }

    /// Unfinished runs of a root session, the runs of its delegations included.
    fn active_in_session(&self, root_session: &SessionId) -> u64 {
        count(self.runs.values().filter(|run| {
            !run.status().is_terminal()
                && (self.sessions.get(&run.session_id)).is_some_and(|s| {
                    run.session_id == *root_session
                        || s.root_session_id.as_ref() == Some(root_session)
                })
        }))
    }

    /// Runs of the tree whose root run is `root`, ended ones included.
    fn tree_runs(&self, root: &RunId) -> u64 {
        count(self.tree_of(root).map(|(_, run)| run))
    }

    /// The root run and every run below it.
    fn tree_of<'a>(&'a self, root: &'a RunId) -> impl Iterator<Item = (&'a RunId, &'a RunRow)> {
        (self.runs.iter()).filter(move |(id, run)| *id == root || run.root_run_id() == Some(root))
    }

    /// The root run of the tree `run_id` is in.
    fn root_of<'a>(&'a self, run_id: &'a RunId) -> Result<&'a RunId> {
        Ok(self.run(run_id)?.root_run_id().unwrap_or(run_id))
    }

    /// Refuses to admit `adding` more runs to `root_session` beyond the quota.
    pub(crate) fn check_quota(
        &self,
        root_session: &SessionId,
        quota: RunQuota,
        adding: u64,
    ) -> Result<()> {
        quota.check(
            root_session,
            adding,
            || Ok(self.active_in_session(root_session)),
            || Ok(self.active_global()),
        )
    }

    /// Starts the children a parent's step created — all of them, or none when the tree's
    /// size or the run quota has no room for them all (the error then undoes the whole write).
    pub(crate) fn start_children(
        &mut self,
        parent: &AgentState,
        children: &[ChildRun],
        quota: RunQuota,
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        let (root, root_session) = tree_root(parent);
        let limit = parent.config.delegation.max_tree_runs;
        tree_has_room(root, self.tree_runs(root), children.len() as u64, limit)
            .map_err(Error::QuotaExceeded)?;
        self.check_quota(root_session, quota, children.len() as u64)?;
        let tenant = self.session(&parent.session_id)?.tenant.clone();
        let mut events = self.reserve(parent, children, now)?;
        for child in children {
            let lineage = &child.lineage;
            if self.sessions.contains_key(&child.session_id) {
                return Err(duplicate("session", &child.session_id));
            }
            self.sessions.insert(
                child.session_id.clone(),
                SessionRow {
                    tenant: tenant.clone(),
                    agent: Some(lineage.agent.clone()),
                    metadata: None,
                    created_at: now,
                    active_run_id: None,
                    archived_at: None,
                    deleted_at: None,
                    title: None,
                    parent_session_id: Some(parent.session_id.clone()),
                    root_session_id: Some(lineage.root_session_id.clone()),
                    user_turns_in_a_row: 0,
                    events: Vec::new(),
                },
            );
            let (mut state, created) = self.insert_queued_run(
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
            let run = self.run_mut(&child.run_id)?;
            run.agent = Some(lineage.agent.clone());
            run.lineage = Some(lineage.clone());
            state.lineage = Some(lineage.clone());
            let mut drafts = vec![created];
            drafts.extend(self.start_queued_run(state, now)?);
            events.extend(self.insert_events(
                &child.session_id,
                Some(&child.run_id),
                drafts,
                now,
            )?);
        }
        Ok(events)
    }

    /// The runs a parent's step started in the foreground, in the order they were created.
    pub(crate) fn foreground_children(&self, parent: &RunId, step: u64) -> Vec<(&RunId, &RunRow)> {
        let mut children: Vec<(&RunId, &RunRow)> = (self.runs.iter())
            .filter(|(_, run)| {
                run.lineage.as_ref().is_some_and(|l| {
                    l.parent_run_id == *parent && l.parent_step == step && l.background.is_none()
                })
            })
            .collect();
        children.sort_by_key(|(_, run)| run.created_order);
        children
    }

    /// How every child of a parent's step ended, read from their states.
    pub(crate) fn children_results(&self, parent: &RunId, step: u64) -> Result<Vec<ChildResult>> {
        (self.foreground_children(parent, step).into_iter())
            .map(|(id, _)| {
                ChildResult::of(&self.load_state(id)?)
                    .ok_or_else(|| Error::Corrupt(format!("child run {id} has no lineage")))
            })
            .collect()
    }

    /// The unfinished runs a parent's foreground delegations started, oldest first (a
    /// background run belongs to the root session, not to its parent).
    pub(crate) fn unfinished_foreground_children(&self, parent: &RunId) -> Vec<RunId> {
        let mut children: Vec<(Millis, &RunId)> = (self.runs.iter())
            .filter(|(_, run)| {
                run.parent_run_id() == Some(parent)
                    && run.inbox_group().is_none()
                    && !run.status().is_terminal()
            })
            .map(|(id, run)| (run.state.created_at, id))
            .collect();
        children.sort();
        children.into_iter().map(|(_, id)| id.clone()).collect()
    }

    /// The run and every run below it, parents before their children, each level in creation
    /// order.
    pub(crate) fn run_tree(&self, run_id: &RunId) -> Result<Vec<TreeNode>> {
        let root = self.root_of(run_id)?;
        let nodes: Vec<TreeNode> = self
            .tree_of(root)
            .map(|(id, run)| TreeNode {
                run_id: id.clone(),
                session_id: run.session_id.clone(),
                parent_run_id: run.parent_run_id().cloned(),
                agent: run.agent.clone(),
                depth: run.depth(),
                background: run.inbox_group().is_some(),
                status: run.status(),
                stop_reason: run.state.stop_reason,
                step_index: run.state.step_index,
                created_at: run.state.created_at,
                finished_at: run.state.finished_at,
                counters: run.state.counters.clone(),
            })
            .collect();
        Ok(subtree(nodes, run_id))
    }

    pub(crate) fn admission(&self, run_id: &RunId) -> Result<Admission> {
        let run = self.run(run_id)?;
        let root_run = self.root_of(run_id)?;
        let session = self.session(&run.session_id)?;
        let root_session = session.root_session_id.as_ref().unwrap_or(&run.session_id);
        Ok(Admission {
            active_global: self.active_global(),
            active_in_session: self.active_in_session(root_session),
            tree_runs: self.tree_runs(root_run),
            inbox_held: self.held(root_session),
        })
    }

    /// What every run of the tree has spent, their counters summed.
    pub(crate) fn tree_spend(&self, run_id: &RunId) -> Result<TreeSpend> {
        let root = self.root_of(run_id)?;
        Ok(
            (self.tree_of(root)).fold(TreeSpend::default(), |spend, (_, run)| {
                spend.with_run(&run.state.counters)
            }),
        )
    }
}

fn count<T>(items: impl Iterator<Item = T>) -> u64 {
    u64::try_from(items.count()).unwrap_or(u64::MAX)
}
