//! Approvals: a gated tool batch waits for a human, whose answer
//! (`ratchet_core::approval::answer_approval`) resumes its run or ends it.

use ratchet_core::{ApprovalAnswer, ApprovalId, Millis, RunStatus};
use ratchet_store::{Answered, Approval, ApprovalStatus, Error, Result};

use crate::tables::{ApprovalRow, Tables};

impl Tables {
    /// An approval as read: a pending one whose run no longer waits for a human reads as
    /// cancelled.
    fn approval_view(&self, row: &ApprovalRow) -> Approval {
        let waits =
            (self.runs.get(&row.run_id)).is_some_and(|run| run.status() == RunStatus::WaitingHuman);
        let status = match row.status {
            ApprovalStatus::Pending if !waits => ApprovalStatus::Cancelled,
            status => status,
        };
        Approval {
            id: row.id.clone(),
            run_id: row.run_id.clone(),
            session_id: row.session_id.clone(),
            status,
            calls: row.calls.clone(),
            answer: row.answer.clone(),
            created_at: row.created_at,
            decided_at: row.decided_at,
        }
    }

    /// A tenant's approvals in the order they were asked for, after `after` when given.
    pub(crate) fn approvals(
        &self,
        tenant: &str,
        status: Option<ApprovalStatus>,
        after: Option<&ApprovalId>,
        limit: u32,
    ) -> Vec<Approval> {
        let start = after
            .and_then(|after| self.approvals.iter().position(|a| a.id == *after))
            .map_or(0, |cursor| cursor + 1);
        (self.approvals[start..].iter())
            .filter(|row| {
                // An approval's run must exist for it to be listed, as a join on runs would.
                self.runs.contains_key(&row.run_id)
                    && (self.sessions.get(&row.session_id)).is_some_and(|s| s.tenant == tenant)
            })
            .map(|row| self.approval_view(row))
            .filter(|approval| status.is_none_or(|status| approval.status == status))
            .take(limit as usize)
            .collect()
    }

    pub(crate) fn get_approval(&self, id: &ApprovalId) -> Result<Approval> {
        (self.approvals.iter())
            .find(|a| a.id == *id && self.runs.contains_key(&a.run_id))
            .map(|row| self.approval_view(row))
            .ok_or_else(|| approval_not_found(id))
    }

    pub(crate) fn answer_approval(
        &mut self,
        id: &ApprovalId,
        answer: ApprovalAnswer,
        by: &str,
        now: Millis,
    ) -> Result<Answered> {
        let approval = self.get_approval(id)?;
        let answer = answer.normalized();
        if let Some(repeat) = approval.answered_again(&answer)? {
            return Ok(repeat);
        }
        let mut state = self.load_state(&approval.run_id)?;
        let (drafts, job) =
            ratchet_core::approval::answer_approval(&mut state, id, &answer, by, now)?;
        self.write_state(&state)?;
        let row = (self.approvals.iter_mut())
            .find(|a| a.id == *id)
            .ok_or_else(|| approval_not_found(id))?;
        row.status = match answer {
            ApprovalAnswer::Abort => ApprovalStatus::Aborted,
            ApprovalAnswer::Decisions(_) => ApprovalStatus::Decided,
        };
        row.answer = Some(answer);
        row.decided_at = Some(now);
        if let Some(job) = &job {
            self.insert_job(job, now)?;
        }
        let mut events = self.insert_events(&state.session_id, Some(&state.run_id), drafts, now)?;
        let mut enqueued = false;
        if state.status.is_terminal() {
            self.run_mut(&state.run_id)?.cancel_requested = true;
            events.extend(self.run_ended(&state, &mut enqueued, now)?);
        }
        Ok(Answered {
            events,
            resumed: job.is_some(),
            enqueued,
            repeated: false,
        })
    }
}

fn approval_not_found(id: &ApprovalId) -> Error {
    Error::NotFound {
        kind: "approval",
        id: id.to_string(),
    }
}
