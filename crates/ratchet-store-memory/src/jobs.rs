//! Step jobs, the work queue of the execution bus: claimed under a lease whose epoch fences
//! every later write of the claim, given back for a retry, released when their owner died.

use ratchet_core::{EventDraft, Millis, RunId, RunStatus, StepJob};
use ratchet_store::{Claim, ClaimedStep, Error, Lease, Result, StoreStats, StoredEvent};

use crate::tables::{JobRow, Tables};

impl Tables {
    /// Claims the job that has waited longest among those due by `now` — of `run` and the
    /// runs of its delegations only, when given. A job exists only beside its run, which
    /// always loads here (there is nothing to decode), so no job is ever set aside.
    pub(crate) fn claim_next(
        &mut self,
        lease: &Lease,
        run: Option<&RunId>,
        now: Millis,
    ) -> Result<Option<ClaimedStep>> {
        let runs = &self.runs;
        let in_scope = |run_id: &RunId| match run {
            None => true,
            Some(run) => {
                run_id == run
                    || runs
                        .get(run_id)
                        .is_some_and(|r| r.root_run_id() == Some(run))
            }
        };
        let oldest = (self.jobs.iter_mut())
            .filter(|((run_id, _), job)| job.ready_at <= now && in_scope(run_id))
            .min_by(|(a_key, a), (b_key, b)| (a.ready_at, a_key).cmp(&(b.ready_at, b_key)));
        let Some(((run_id, step_index), job)) = oldest else {
            return Ok(None);
        };
        let (run_id, step_index) = (run_id.clone(), *step_index);
        job.attempt += 1;
        job.epoch += 1;
        job.lease_owner = Some(lease.owner.clone());
        job.ready_at = lease.expires_at;
        let (phase, attempt, epoch) = (job.phase, job.attempt, job.epoch);
        Ok(Some(ClaimedStep {
            job: StepJob {
                run_id: run_id.clone(),
                step_index,
                phase,
                attempt,
            },
            claim: Claim {
                run_id: run_id.clone(),
                step_index,
                epoch,
            },
            state: self.load_state(&run_id)?,
            context: None,
        }))
    }

    /// The job `claim` holds, while it still holds it.
    fn claimed_job_mut(&mut self, claim: &Claim) -> Option<&mut JobRow> {
        (self.jobs.get_mut(&(claim.run_id.clone(), claim.step_index)))
            .filter(|job| job.epoch == claim.epoch)
    }

    /// The epoch of the job `claim` names, while that job exists.
    pub(crate) fn job_epoch(&self, claim: &Claim) -> Option<i64> {
        (self.jobs.get(&(claim.run_id.clone(), claim.step_index))).map(|job| job.epoch)
    }

    /// Refuses with `Error::LeaseLost` once `claim` no longer holds its step.
    pub(crate) fn fenced(&self, claim: &Claim) -> Result<()> {
        if self.job_epoch(claim) == Some(claim.epoch) {
            Ok(())
        } else {
            Err(Error::LeaseLost {
                run_id: claim.run_id.clone(),
                step_index: claim.step_index,
            })
        }
    }

    pub(crate) fn heartbeat(&mut self, claim: &Claim, expires_at: Millis) -> bool {
        match self.claimed_job_mut(claim) {
            Some(job) => {
                job.ready_at = expires_at;
                true
            }
            None => false,
        }
    }

    pub(crate) fn retry_later(
        &mut self,
        claim: &Claim,
        available_at: Millis,
        event: EventDraft,
        now: Millis,
    ) -> Result<Option<Vec<StoredEvent>>> {
        let Some(job) = self.claimed_job_mut(claim) else {
            return Ok(None);
        };
        job.lease_owner = None;
        job.ready_at = available_at;
        let run = self.run(&claim.run_id)?;
        let (session_id, pausing) = (
            run.session_id.clone(),
            run.pause_requested && run.status() == RunStatus::Running,
        );
        let mut events = self.insert_events(&session_id, Some(&claim.run_id), vec![event], now)?;
        // Waiting out a backoff is a step boundary too.
        if pausing {
            events.extend(
                self.pause_if_unclaimed(&claim.run_id, &session_id, now)?
                    .unwrap_or_default(),
            );
        }
        Ok(Some(events))
    }

    /// Owners of leases currently held, live or not.
    pub(crate) fn lease_owners(&self) -> Vec<String> {
        let mut owners: Vec<String> = (self.jobs.values())
            .filter_map(|job| job.lease_owner.clone())
            .collect();
        owners.sort();
        owners.dedup();
        owners
    }

    /// Releases every lease `owner` holds, making its jobs claimable at once.
    pub(crate) fn release_leases(&mut self, owner: &str) -> u64 {
        let mut released = 0;
        for job in self.jobs.values_mut() {
            if job.lease_owner.as_deref() == Some(owner) {
                job.lease_owner = None;
                job.ready_at = 0;
                released += 1;
            }
        }
        released
    }

    pub(crate) fn runs_with_jobs(&self) -> Vec<RunId> {
        let mut runs: Vec<RunId> = self.jobs.keys().map(|(run, _)| run.clone()).collect();
        runs.dedup();
        runs
    }

    pub(crate) fn stats(&self, now: Millis) -> StoreStats {
        let mut runs_by_status: Vec<(RunStatus, u64)> = Vec::new();
        for run in self.runs.values() {
            match runs_by_status.iter_mut().find(|(s, _)| *s == run.status()) {
                Some((_, count)) => *count += 1,
                None => runs_by_status.push((run.status(), 1)),
            }
        }
        runs_by_status.sort_by_key(|(status, _)| status.as_str());
        let ready_jobs = self.jobs.values().filter(|job| job.ready_at <= now).count();
        StoreStats {
            runs_by_status,
            ready_jobs: ready_jobs as u64,
            held_jobs: (self.jobs.len() - ready_jobs) as u64,
        }
    }
}
