//! Runs: submitted into a session (started at once, queued, steering the active run or
//! interrupting it), started when their session frees up, and moved by a person — cancelled,
//! paused, resumed, reconciled, continued after a failure — or by the overdue sweep. Every
//! move is decided by `ratchet-core`; this module applies it.

use std::sync::Arc;

use ratchet_core::delegation::{ChildResult, child_finished, join_children};
use ratchet_core::inbox::{NextTurn, input_message, wakes_held_events};
use ratchet_core::step::{Reconciliation, Resumption, cancel_idle, start_run};
use ratchet_core::{
    AgentState, EventDraft, EventKind, Instruction, Millis, RunConfigSnapshot, RunId, RunStatus,
    SessionId, StepJob, StepRecord, TraceContext,
};
use ratchet_store::{
    ApprovalStatus, CancelOutcome, Error, NewRun, PauseOutcome, Reconciled, Result, ResumeOutcome,
    RunSummary, StoredEvent, Submitted, TimedOut, WhenBusy, step_message_id,
};
use serde_json::json;

use crate::tables::{JobRow, RunInput, RunRow, Tables, duplicate, session_not_found};

/// Most overdue runs one sweep ends.
const OVERDUE_PER_SWEEP: usize = 100;

impl Tables {
    pub(crate) fn submit_message(&mut self, new: NewRun, now: Millis) -> Result<Submitted> {
        let session = (self.sessions.get(&new.session_id))
            .filter(|s| s.deleted_at.is_none())
            .ok_or_else(|| session_not_found(&new.session_id))?;
        if session.archived_at.is_some() {
            return Err(Error::Conflict(format!(
                "session {} is archived and takes no more messages; start a new session",
                new.session_id
            )));
        }
        if let Some(root) = &session.root_session_id {
            return Err(Error::Invalid(format!(
                "session {} holds a delegated run; send messages to its root session {root}",
                new.session_id
            )));
        }
        let active = session.active_run_id.clone();
        if new.when_busy != WhenBusy::Steer || active.is_none() {
            self.check_quota(&new.session_id, new.quota, 1)?;
        }
        match (&active, new.when_busy) {
            (Some(active), WhenBusy::Reject) => {
                return Err(Error::Conflict(format!(
                    "session {} has an active run ({active}); send with multitask \"enqueue\" to queue behind it",
                    new.session_id
                )));
            }
            (Some(active), WhenBusy::Steer) => {
                self.queue_steer(&new, active, now)?;
                let woke = self.wake_on_input(&new.session_id, now)?;
                return Ok(Submitted {
                    status: self.run(active)?.status(),
                    events: Vec::new(),
                    interrupted: None,
                    steered_into: Some(active.clone()),
                    woke,
                });
            }
            _ => {}
        }
        let (state, created) = self.insert_queued_run(
            &new.session_id,
            &new.run_id,
            new.message_id.as_str(),
            &new.content,
            new.config,
            new.trace,
            now,
        )?;
        // A session is called by its first message until someone renames it.
        let session = self.session_mut(&new.session_id)?;
        if session.title.is_none() {
            session.title = Some(ratchet_core::message::title_of(&new.content));
        }
        let Some(active) = active else {
            let mut drafts = vec![created];
            drafts.extend(self.start_queued_run(state, now)?);
            let events = self.insert_events(&new.session_id, Some(&new.run_id), drafts, now)?;
            return Ok(Submitted {
                status: RunStatus::Running,
                events,
                interrupted: None,
                steered_into: None,
                woke: None,
            });
        };
        let mut events =
            self.insert_events(&new.session_id, Some(&new.run_id), vec![created], now)?;
        let mut interrupted = None;
        let mut woke = None;
        if new.when_busy == WhenBusy::Interrupt {
            // A cancel that ends the active run at once frees the session, and the queue (this
            // run included) moves on in the same write.
            match self.request_cancel(&active, now)? {
                CancelOutcome::Cancelled { events: more, .. }
                | CancelOutcome::Cancelling { events: more } => events.extend(more),
                CancelOutcome::AlreadyTerminal(_) => {}
            }
            interrupted = Some(active);
        } else {
            woke = self.wake_on_input(&new.session_id, now)?;
        }
        Ok(Submitted {
            status: self.run(&new.run_id)?.status(),
            events,
            interrupted,
            steered_into: None,
            woke,
        })
    }

    /// Inserts a run waiting in its session's queue, with the message that will start it.
    #[expect(
        clippy::too_many_arguments,
        reason = "each is a field of the new run's row or state, given by every kind of run creation"
    )]
    pub(crate) fn insert_queued_run(
        &mut self,
        session_id: &SessionId,
        run_id: &RunId,
        message_id: &str,
        content: &str,
        config: RunConfigSnapshot,
        trace: Option<TraceContext>,
        created_at: Millis,
    ) -> Result<(AgentState, EventDraft)> {
        if self.runs.contains_key(run_id) {
            return Err(duplicate("run", run_id));
        }
        if !self.sessions.contains_key(session_id) {
            return Err(Error::Backend(format!(
                "FOREIGN KEY constraint failed: run {run_id} names session {session_id}, which does not exist"
            )));
        }
        let mut state = AgentState::new(session_id.clone(), run_id.clone(), config, created_at);
        state.trace = trace;
        let run = RunRow {
            created_order: u64::try_from(self.runs.len()).unwrap_or(u64::MAX),
            session_id: session_id.clone(),
            state: state.clone(),
            config: Arc::clone(&state.config),
            cancel_requested: false,
            pause_requested: false,
            input: RunInput {
                message_id: message_id.to_owned(),
                content: content.to_owned(),
            },
            agent: state.config.agent.as_ref().map(|a| a.id.clone()),
            lineage: None,
            deadline_at: None,
        };
        self.runs.insert(run_id.clone(), run);
        // The message rides along so that a client can draw a queued turn from the events
        // alone; a continuation's trigger is hidden from clients, so only its origin is told.
        let created = if state.config.continuation {
            json!({"run_id": run_id, "message_id": message_id, "origin": "continuation"})
        } else {
            json!({"run_id": run_id, "message_id": message_id, "content": content})
        };
        Ok((state, EventDraft::new(EventKind::RunCreated, created)))
    }

    /// Makes a queued run its session's active run: its message enters history and its first
    /// job is enqueued.
    pub(crate) fn start_queued_run(
        &mut self,
        mut state: AgentState,
        now: Millis,
    ) -> Result<Vec<EventDraft>> {
        let input = self.run(&state.run_id)?.input.clone();
        let message = input_message(&state, input.content);
        self.insert_message(&input.message_id, &state, message, now)?;
        if wakes_held_events(&state) {
            self.wake_held(&state.session_id, now);
        }
        let (job, event) = start_run(&mut state, now);
        self.write_state(&state)?;
        self.insert_job(&job, now)?;
        let session = self.session_mut(&state.session_id)?;
        session.active_run_id = Some(state.run_id.clone());
        session.user_turns_in_a_row = if state.config.continuation {
            0
        } else {
            session.user_turns_in_a_row.saturating_add(1)
        };
        Ok(vec![event])
    }

    /// Stores `state` as the run's. A waiting run's deadline is kept beside it, for the
    /// overdue sweep; a running one is cut off by the worker that holds its step.
    pub(crate) fn write_state(&mut self, state: &AgentState) -> Result<()> {
        let run = self.run_mut(&state.run_id)?;
        let waits = matches!(
            state.status,
            RunStatus::WaitingHuman | RunStatus::WaitingChildren | RunStatus::WaitingTimer
        );
        run.deadline_at = state.deadline().filter(|_| waits);
        run.state = state.clone();
        // A run's end closes the approvals it still waited on: a continue cannot revive them.
        if state.status.is_terminal() {
            let asked = (self.approvals.iter_mut())
                .filter(|a| a.run_id == state.run_id && a.status == ApprovalStatus::Pending);
            for approval in asked {
                approval.status = ApprovalStatus::Cancelled;
                approval.decided_at = state.finished_at;
            }
        }
        Ok(())
    }

    /// Enqueues a job nobody holds, claimable from `now` (a timer's due time).
    pub(crate) fn insert_job(&mut self, job: &StepJob, now: Millis) -> Result<()> {
        let key = (job.run_id.clone(), job.step_index);
        if self.jobs.contains_key(&key) {
            return Err(duplicate(
                "step job",
                format!("{}#{}", job.run_id, job.step_index),
            ));
        }
        self.jobs.insert(
            key,
            JobRow {
                phase: job.phase,
                attempt: 0,
                epoch: 0,
                lease_owner: None,
                ready_at: now,
            },
        );
        Ok(())
    }

    fn remove_jobs_of(&mut self, run_id: &RunId) {
        self.jobs.retain(|(run, _), _| run != run_id);
    }

    /// A run has just ended (its terminal state written): its session's queue moves on, and —
    /// if it is a child — its parent hears of it and, when this was the last of the children
    /// it waits for, is joined: running again with every child's result, its next job
    /// enqueued.
    pub(crate) fn run_ended(
        &mut self,
        state: &AgentState,
        enqueued: &mut bool,
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        let mut events = Vec::new();
        if state.config.continuation {
            events.extend(self.continuation_ended(state, now)?);
        }
        events.extend(self.release_session(&state.session_id, enqueued, now)?);
        let (Some(lineage), Some(finished)) = (&state.lineage, ChildResult::of(state)) else {
            return Ok(events);
        };
        let parent_id = &lineage.parent_run_id;
        let mut parent = self.load_state(parent_id)?;
        let mut drafts = vec![child_finished(parent_id, &finished)];
        let waiting_on_this = lineage.background.is_none()
            && parent.status == RunStatus::WaitingChildren
            && parent.step_index == lineage.parent_step;
        if waiting_on_this
            && (self
                .foreground_children(parent_id, lineage.parent_step)
                .iter())
            .all(|(_, child)| child.status().is_terminal())
        {
            let results = self.children_results(parent_id, lineage.parent_step)?;
            let (joined, job) = join_children(&mut parent, results)?;
            self.write_state(&parent)?;
            self.insert_job(&job, now)?;
            *enqueued = true;
            drafts.extend(joined);
        }
        events.extend(self.insert_events(&parent.session_id, Some(parent_id), drafts, now)?);
        events.extend(self.background_ended(state, enqueued, now)?);
        Ok(events)
    }

    /// The session's active run has ended: the steers it never took in become runs of their
    /// own, then the oldest queued run starts — or a continuation turn, when due inbox events
    /// have waited their turn (`NextTurn`).
    fn release_session(
        &mut self,
        session_id: &SessionId,
        enqueued: &mut bool,
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        self.session_mut(session_id)?.active_run_id = None;
        let mut fell_through = Vec::new();
        for steer in self.take_steers(session_id) {
            let (_, created) = self.insert_queued_run(
                session_id,
                &steer.run_id,
                &steer.message_id,
                &steer.content,
                steer.config,
                None,
                steer.created_at,
            )?;
            fell_through.push((steer.run_id, created));
        }
        let next = (self.runs.iter())
            .filter(|(_, run)| run.session_id == *session_id && run.status() == RunStatus::Queued)
            .min_by_key(|(_, run)| (run.state.created_at, run.created_order))
            .map(|(id, _)| id.clone());
        let mut events = Vec::new();
        for (run_id, created) in fell_through {
            events.extend(self.insert_events(session_id, Some(&run_id), vec![created], now)?);
        }
        match self.choose_next_turn(session_id, next.is_some(), now)? {
            NextTurn::Idle => {}
            NextTurn::Continuation => {
                *enqueued = true;
                events.extend(self.start_continuation(session_id, now)?);
            }
            NextTurn::User => {
                let next = next.ok_or_else(|| {
                    Error::Corrupt(format!("a user turn of {session_id} with no queued run"))
                })?;
                let state = self.load_state(&next)?;
                *enqueued = true;
                let drafts = self.start_queued_run(state, now)?;
                events.extend(self.insert_events(session_id, Some(&next), drafts, now)?);
            }
        }
        Ok(events)
    }

    /// Cancels a run (see `CancelOutcome`) and every unfinished run its foreground
    /// delegations started, down the tree.
    pub(crate) fn request_cancel(&mut self, run_id: &RunId, now: Millis) -> Result<CancelOutcome> {
        let mut outcome = self.cancel_one(run_id, now)?;
        for child in self.unfinished_foreground_children(run_id) {
            outcome.absorb(self.request_cancel(&child, now)?);
        }
        Ok(outcome)
    }

    /// Cancels one run, without looking at its children.
    pub(crate) fn cancel_one(&mut self, run_id: &RunId, now: Millis) -> Result<CancelOutcome> {
        let run = self.run(run_id)?;
        let (status, session_id) = (run.status(), run.session_id.clone());
        let mut state = self.load_state(run_id)?;
        match status {
            RunStatus::Running | RunStatus::Cancelling => {
                self.run_mut(run_id)?.cancel_requested = true;
                let mut drafts = Vec::new();
                if status == RunStatus::Running {
                    state.status = RunStatus::Cancelling;
                    self.write_state(&state)?;
                    drafts.push(EventDraft::new(
                        EventKind::RunStatus,
                        json!({"run_id": run_id, "status": state.status}),
                    ));
                }
                let events = self.insert_events(&session_id, Some(run_id), drafts, now)?;
                Ok(CancelOutcome::Cancelling { events })
            }
            // A run waiting on a timer ends now even while a worker holds its job: that step
            // has no effect outside the store, and its commit finds the job gone.
            RunStatus::Queued
            | RunStatus::WaitingHuman
            | RunStatus::WaitingChildren
            | RunStatus::WaitingTimer
            | RunStatus::Paused => {
                let (drafts, closing) = cancel_idle(&mut state, now);
                self.run_mut(run_id)?.cancel_requested = true;
                self.write_state(&state)?;
                // The closed batch's results come after the run's last step.
                for (slot, message) in closing.into_iter().enumerate() {
                    let id = step_message_id(run_id, state.step_index + 1, slot);
                    self.insert_message(&id, &state, message, now)?;
                }
                self.remove_jobs_of(run_id);
                let mut events = self.insert_events(&session_id, Some(run_id), drafts, now)?;
                let mut enqueued = false;
                // A queued run never held its session: nothing moves on when it goes.
                if status != RunStatus::Queued {
                    events.extend(self.run_ended(&state, &mut enqueued, now)?);
                }
                Ok(CancelOutcome::Cancelled { events, enqueued })
            }
            RunStatus::Completed | RunStatus::Failed | RunStatus::Cancelled => {
                Ok(CancelOutcome::AlreadyTerminal(status))
            }
        }
    }

    pub(crate) fn request_pause(&mut self, run_id: &RunId, now: Millis) -> Result<PauseOutcome> {
        let run = self.run(run_id)?;
        match run.status() {
            RunStatus::Paused => return Ok(PauseOutcome::Paused { events: Vec::new() }),
            RunStatus::Running => {}
            RunStatus::WaitingTimer => {
                let session_id = run.session_id.clone();
                return self
                    .pause_waiting(run_id, &session_id, now)
                    .map(|events| PauseOutcome::Paused { events });
            }
            status => {
                return Err(Error::Conflict(format!(
                    "run {run_id} is {status}; only a running run can be paused (or one waiting on a timer)"
                )));
            }
        }
        let session_id = run.session_id.clone();
        if let Some(events) = self.pause_if_unclaimed(run_id, &session_id, now)? {
            return Ok(PauseOutcome::Paused { events });
        }
        self.run_mut(run_id)?.pause_requested = true;
        Ok(PauseOutcome::Pausing)
    }

    /// A job nobody has claimed is a step boundary: the run pauses now, and its job goes.
    /// None when its job is held (the step's commit pauses the run instead).
    pub(crate) fn pause_if_unclaimed(
        &mut self,
        run_id: &RunId,
        session_id: &SessionId,
        now: Millis,
    ) -> Result<Option<Vec<StoredEvent>>> {
        let unclaimed = (self.jobs.iter())
            .find(|((run, _), job)| run == run_id && job.lease_owner.is_none())
            .map(|(key, job)| (key.clone(), job.phase));
        let Some((key, phase)) = unclaimed else {
            return Ok(None);
        };
        self.jobs.remove(&key);
        let mut state = self.load_state(run_id)?;
        let drafts = ratchet_core::step::pause_idle(&mut state, phase, now)?;
        self.write_state(&state)?;
        self.run_mut(run_id)?.pause_requested = false;
        self.insert_events(session_id, Some(run_id), drafts, now)
            .map(Some)
    }

    /// A run waiting on a timer pauses at once, keeping its due time; its job goes, even
    /// while a worker holds it (that step has no effect outside the store).
    fn pause_waiting(
        &mut self,
        run_id: &RunId,
        session_id: &SessionId,
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        self.remove_jobs_of(run_id);
        let mut state = self.load_state(run_id)?;
        let drafts =
            ratchet_core::step::pause_idle(&mut state, ratchet_core::Phase::WaitEnded, now)?;
        self.write_state(&state)?;
        self.run_mut(run_id)?.pause_requested = false;
        self.insert_events(session_id, Some(run_id), drafts, now)
    }

    /// Input arrived for `session`: its active run, if it waits on a timer that has not ended
    /// (or is paused while it does), wakes; its job is ready now (a paused run's is written
    /// when it is resumed). Returns the run woken.
    pub(crate) fn wake_on_input(
        &mut self,
        session: &SessionId,
        now: Millis,
    ) -> Result<Option<RunId>> {
        let Some(run_id) = (self.sessions.get(session)).and_then(|s| s.active_run_id.clone())
        else {
            return Ok(None);
        };
        let mut state = self.load_state(&run_id)?;
        if !ratchet_core::timer::wake_by_input(&mut state, now) {
            return Ok(None);
        }
        self.write_state(&state)?;
        if state.status == RunStatus::WaitingTimer {
            let at = ratchet_core::timer::job_ready_at(&state, now);
            for ((run, _), job) in self.jobs.iter_mut() {
                if *run == run_id && job.lease_owner.is_none() && job.ready_at > at {
                    job.ready_at = at;
                }
            }
        }
        Ok(Some(run_id))
    }

    pub(crate) fn resume_paused(&mut self, run_id: &RunId, now: Millis) -> Result<ResumeOutcome> {
        let run = self.run_mut(run_id)?;
        if run.status() == RunStatus::Running && run.pause_requested {
            run.pause_requested = false;
            return Ok(ResumeOutcome::PauseWithdrawn);
        }
        let session_id = run.session_id.clone();
        let mut state = self.load_state(run_id)?;
        let (mut drafts, job) = ratchet_core::step::resume_paused(&mut state, now)?;
        self.write_state(&state)?;
        self.insert_job(&job, ratchet_core::timer::job_ready_at(&state, now))?;
        if matches!(
            ratchet_core::decide(&state, job.phase, now),
            Instruction::CallLlm { .. }
        ) {
            let mut added = Vec::new();
            drafts.extend(self.absorb_steers(&state, &mut added, now)?);
            drafts.extend(self.absorb_signals(&state, state.step_index, &mut added, now)?);
        }
        let events = self.insert_events(&session_id, Some(run_id), drafts, now)?;
        Ok(ResumeOutcome::Resumed { events })
    }

    pub(crate) fn reconcile(
        &mut self,
        run_id: &RunId,
        call_id: &str,
        answer: Reconciliation,
        result: Option<String>,
        now: Millis,
    ) -> Result<Reconciled> {
        let mut state = self.load_state(run_id)?;
        let (drafts, job) = ratchet_core::step::reconcile(&mut state, call_id, answer, result)?;
        self.write_state(&state)?;
        if let Some(job) = &job {
            self.insert_job(job, now)?;
        }
        let events = self.insert_events(&state.session_id, Some(run_id), drafts, now)?;
        Ok(Reconciled {
            events,
            resumed: job.is_some(),
        })
    }

    pub(crate) fn resume_failed(
        &mut self,
        run_id: &RunId,
        how: Resumption,
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        let mut state = self.load_state(run_id)?;
        ratchet_core::step::may_resume_failed(&state).map_err(Error::Conflict)?;
        let (drafts, job) = ratchet_core::step::resume_failed(&mut state, how, now)?;
        // The run takes its session back only if nobody else holds it: one active run each.
        let session = self.session_mut(&state.session_id)?;
        if let Some(other) = &session.active_run_id {
            return Err(Error::Conflict(format!(
                "session {} has another active run ({other}); continue {run_id} once it has ended",
                state.session_id
            )));
        }
        session.active_run_id = Some(run_id.clone());
        self.write_state(&state)?;
        self.insert_job(&job, now)?;
        self.insert_events(&state.session_id, Some(run_id), drafts, now)
    }

    /// Waiting runs whose deadline is at or before `now`, oldest deadline first.
    pub(crate) fn overdue_runs(&self, now: Millis) -> Vec<RunId> {
        let mut overdue: Vec<(Millis, &RunId)> = (self.runs.iter())
            .filter_map(|(id, run)| run.deadline_at.filter(|at| *at <= now).map(|at| (at, id)))
            .collect();
        overdue.sort();
        (overdue.into_iter())
            .take(OVERDUE_PER_SWEEP)
            .map(|(_, id)| id.clone())
            .collect()
    }

    /// Ends a waiting run past its deadline as `timed_out`, cancelling the children it waited
    /// for. A run that moved on meanwhile is left alone.
    pub(crate) fn time_out_run(&mut self, run_id: &RunId, now: Millis) -> Result<TimedOut> {
        let run = self.run(run_id)?;
        let (status, session_id) = (run.status(), run.session_id.clone());
        let mut state = self.load_state(run_id)?;
        let waiting = matches!(
            status,
            RunStatus::WaitingHuman | RunStatus::WaitingChildren | RunStatus::WaitingTimer
        );
        if !waiting || state.deadline().is_none_or(|deadline| deadline > now) {
            return Ok(TimedOut::default());
        }
        let mut ended = TimedOut {
            ended: vec![run_id.clone()],
            ..TimedOut::default()
        };
        let children = self.unfinished_foreground_children(run_id);
        let drafts = ratchet_core::step::time_out_idle(&mut state, now);
        self.write_state(&state)?;
        self.remove_jobs_of(run_id);
        ended.events = self.insert_events(&session_id, Some(run_id), drafts, now)?;
        for child in children {
            match self.request_cancel(&child, now)? {
                CancelOutcome::Cancelled { events, enqueued } => {
                    ended.events.extend(events);
                    ended.enqueued |= enqueued;
                }
                CancelOutcome::Cancelling { events } => ended.events.extend(events),
                CancelOutcome::AlreadyTerminal(_) => {}
            }
        }
        let events = self.run_ended(&state, &mut ended.enqueued, now)?;
        ended.events.extend(events);
        Ok(ended)
    }

    /// Every run, in the order they were created.
    pub(crate) fn list_runs(&self) -> Vec<RunSummary> {
        let mut runs: Vec<(&RunId, &RunRow)> = self.runs.iter().collect();
        runs.sort_by_key(|(_, run)| run.created_order);
        runs.into_iter().map(summary).collect()
    }

    /// A session's runs in id order, after `after` when given.
    pub(crate) fn session_runs(
        &self,
        session_id: &SessionId,
        after: Option<&RunId>,
        limit: u32,
    ) -> Vec<RunSummary> {
        (self.runs.iter())
            .filter(|(id, run)| run.session_id == *session_id && after.is_none_or(|a| *id > a))
            .take(limit as usize)
            .map(summary)
            .collect()
    }

    pub(crate) fn steps(&self, run_id: &RunId) -> Vec<StepRecord> {
        (self
            .steps
            .range((run_id.clone(), 0)..=(run_id.clone(), u64::MAX)))
        .map(|(_, step)| step.clone())
        .collect()
    }
}

fn summary((run_id, run): (&RunId, &RunRow)) -> RunSummary {
    RunSummary {
        run_id: run_id.clone(),
        session_id: run.session_id.clone(),
        status: run.status(),
        stop_reason: run.state.stop_reason,
        step_index: run.state.step_index,
        created_at: run.state.created_at,
        finished_at: run.state.finished_at,
        forked_from: run.state.forked_from.clone(),
        schedule_id: run.state.schedule.as_ref().map(|s| s.schedule_id.clone()),
        slot: run.state.schedule.as_ref().map(|s| s.slot),
    }
}
