//! Step commits and the write-ahead intents of the step in flight. A commit is fenced three
//! ways — the claim's epoch, the run's committed step, the status edge — and writes nothing
//! when any of them fails.

use std::sync::Arc;

use ratchet_core::{
    AgentState, EventDraft, HumanRequest, Millis, RunId, RunStatus, StepJob, StepResult,
    ToolOutcome,
};
use ratchet_store::{
    ApprovalStatus, Claim, ClaimedStep, Commit, Error, Intent, IntentRecord, Lease,
    RecordedIntents, Result, RunQuota, Stale,
};

use crate::tables::{ApprovalRow, IntentRow, JobRow, Tables, duplicate};
use ratchet_store::step_message_id;

impl Tables {
    pub(crate) fn commit_step(
        &mut self,
        claim: &Claim,
        mut result: StepResult,
        continue_with: Option<Lease>,
        quota: RunQuota,
        now: Millis,
    ) -> Result<Commit> {
        if result.record.index != claim.step_index || result.state.run_id != claim.run_id {
            return Err(Error::Conflict(format!(
                "result of {}#{} committed under the claim of {}#{}",
                result.state.run_id, result.record.index, claim.run_id, claim.step_index
            )));
        }
        let run = self.run(&claim.run_id)?;
        let session_id = run.session_id.clone();
        let (stored_status, stored_step) = (run.status(), run.state.step_index);
        let (cancel_requested, pause_requested) = (run.cancel_requested, run.pause_requested);
        if cancel_requested {
            result.yield_to_cancel();
        }
        let paused = pause_requested && result.yield_to_pause();
        // Input that arrived while the step ran ends the wait it parks on at once.
        if result.state.status == RunStatus::WaitingTimer
            && result.state.lineage.is_none()
            && (self.pending_input(&session_id, now))
                .wakes(result.state.checkpoint.as_ref().and_then(|b| b.asked_at))
        {
            ratchet_core::timer::wake_by_input(&mut result.state, now);
        }
        let refused = if stored_step + 1 != claim.step_index {
            Some(Stale::StepMismatch {
                committed: stored_step,
                job: claim.step_index,
            })
        } else {
            stored_status
                .edge(result.state.status)
                .err()
                .map(Stale::Edge)
        };
        if self.job_epoch(claim) != Some(claim.epoch) {
            return Ok(Commit::Stale(Stale::LeaseLost));
        }
        if let Some(refused) = refused {
            return Ok(Commit::Stale(refused));
        }
        // A run that waits on a timer is woken by its job at the due time, by whichever
        // worker is idle then: the job is nobody's, and the committer does not go on with it.
        let continue_with =
            continue_with.filter(|_| result.state.status != RunStatus::WaitingTimer);
        let ready_at = ratchet_core::timer::job_ready_at(&result.state, now);
        self.advance_job(
            claim,
            result.next.as_ref(),
            continue_with.as_ref(),
            ready_at,
        )?;
        let steer_boundary = result.accepts_steer();
        self.write_state(&result.state)?;
        if paused {
            self.run_mut(&claim.run_id)?.pause_requested = false;
        }
        if let Some(HumanRequest::Approval { approval_id, calls }) = &result.state.pending_human {
            if self.approvals.iter().any(|a| a.id == *approval_id) {
                return Err(duplicate("approval", approval_id));
            }
            self.approvals.push(ApprovalRow {
                id: approval_id.clone(),
                run_id: claim.run_id.clone(),
                session_id: session_id.clone(),
                status: ApprovalStatus::Pending,
                calls: calls.clone(),
                answer: None,
                created_at: now,
                decided_at: None,
            });
        }
        for (slot, message) in result.messages.iter().enumerate() {
            let id = step_message_id(&claim.run_id, claim.step_index, slot);
            self.insert_message(&id, &result.state, message.clone(), now)?;
        }
        let step_key = (claim.run_id.clone(), result.record.index);
        if self.steps.contains_key(&step_key) {
            return Err(duplicate(
                "step",
                format!("{}#{}", claim.run_id, result.record.index),
            ));
        }
        self.steps.insert(step_key, result.record.clone());
        let mut enqueued = result.next.is_some() && continue_with.is_none() && ready_at <= now;
        let mut drafts = std::mem::take(&mut result.events);
        let mut added = std::mem::take(&mut result.messages);
        if steer_boundary {
            drafts.extend(self.absorb_steers(&result.state, &mut added, now)?);
            drafts.extend(self.absorb_signals(&result.state, claim.step_index, &mut added, now)?);
        }
        let mut events = self.insert_events(&session_id, Some(&claim.run_id), drafts, now)?;
        if !result.children.is_empty() {
            events.extend(self.start_children(&result.state, &result.children, quota, now)?);
            enqueued = true;
        }
        if result.state.status.is_terminal() {
            events.extend(self.run_ended(&result.state, &mut enqueued, now)?);
        }
        let continued = match (result.next, continue_with.is_some()) {
            (Some(next), true) => Some(ClaimedStep {
                claim: Claim {
                    run_id: next.run_id.clone(),
                    step_index: next.step_index,
                    epoch: FIRST_CLAIM_EPOCH,
                },
                job: StepJob { attempt: 1, ..next },
                // The state as a claim would load it: the frozen config and the store's flags,
                // never the ones the result carried.
                state: AgentState {
                    config: Arc::clone(&self.run(&claim.run_id)?.config),
                    cancel_requested,
                    pause_requested,
                    ..result.state
                },
                context: None,
            }),
            _ => None,
        };
        Ok(Commit::Committed {
            events,
            continued,
            added,
            enqueued,
        })
    }

    /// Moves the claimed job on to `next` (or removes it): leased at once to the committer that
    /// continues with it, or free for any worker from `now` (a timer's due time).
    fn advance_job(
        &mut self,
        claim: &Claim,
        next: Option<&StepJob>,
        continue_with: Option<&Lease>,
        now: Millis,
    ) -> Result<()> {
        self.jobs.remove(&(claim.run_id.clone(), claim.step_index));
        let Some(next) = next else {
            return Ok(());
        };
        let key = (claim.run_id.clone(), next.step_index);
        if self.jobs.contains_key(&key) {
            return Err(duplicate(
                "step job",
                format!("{}#{}", claim.run_id, next.step_index),
            ));
        }
        let job = match continue_with {
            Some(lease) => JobRow {
                phase: next.phase,
                attempt: 1,
                epoch: FIRST_CLAIM_EPOCH,
                lease_owner: Some(lease.owner.clone()),
                ready_at: lease.expires_at,
            },
            None => JobRow {
                phase: next.phase,
                attempt: 0,
                epoch: 0,
                lease_owner: None,
                ready_at: now,
            },
        };
        self.jobs.insert(key, job);
        Ok(())
    }

    pub(crate) fn record_intents(
        &mut self,
        claim: &Claim,
        intents: Vec<Intent>,
        events: Vec<EventDraft>,
        now: Millis,
    ) -> Result<RecordedIntents> {
        self.fenced(claim)?;
        let run = self.run(&claim.run_id)?;
        if run.cancel_requested {
            return Err(Error::CancelRequested {
                run_id: claim.run_id.clone(),
            });
        }
        let session_id = run.session_id.clone();
        let mut attempts = Vec::with_capacity(intents.len());
        for intent in intents {
            let key = (claim.run_id.clone(), claim.step_index, intent.slot);
            let row = self.intents.entry(key).or_insert(IntentRow {
                kind: intent.kind,
                name: intent.name,
                attempts: 0,
                outcome: None,
            });
            row.attempts += 1;
            attempts.push(row.attempts);
        }
        let events = self.insert_events(&session_id, Some(&claim.run_id), events, now)?;
        Ok(RecordedIntents { events, attempts })
    }

    pub(crate) fn record_outcome(
        &mut self,
        claim: &Claim,
        slot: u32,
        outcome: ToolOutcome,
    ) -> Result<()> {
        self.fenced(claim)?;
        let (run_id, step_index) = (&claim.run_id, claim.step_index);
        let intent =
            (self.intents.get_mut(&(run_id.clone(), step_index, slot))).ok_or_else(|| {
                Error::Conflict(format!(
                    "no intent at {run_id}#{step_index}#{slot} to record an outcome for"
                ))
            })?;
        intent.outcome = Some(outcome);
        Ok(())
    }

    /// A step's intents in slot order.
    pub(crate) fn intents(&self, run_id: &RunId, step_index: u64) -> Vec<IntentRecord> {
        let slots = (run_id.clone(), step_index, 0)..=(run_id.clone(), step_index, u32::MAX);
        (self.intents.range(slots))
            .map(|((_, _, slot), intent)| IntentRecord {
                slot: *slot,
                kind: intent.kind,
                name: intent.name.clone(),
                attempts: intent.attempts,
                outcome: intent.outcome.clone(),
            })
            .collect()
    }
}

/// The epoch of a job's first claim: a job continued under its committer's lease starts at it.
const FIRST_CLAIM_EPOCH: i64 = 1;
