//! A run's steps as jobs: the outbox of step jobs and their leases (claim, heartbeat, retry,
//! release), the fence a claim is checked against, the step's commit (`commit_step`, with what
//! it encodes before its transaction, `EncodedStep`), the intents a step records before its
//! effects, and the committed steps read back.

use ratchet_core::{
    AgentState, EventDraft, HumanRequest, Millis, Phase, RunId, RunStatus, StepJob, StepRecord,
    StepResult, ToolOutcome,
};
use ratchet_store::{
    Claim, ClaimedStep, Commit, Error, Intent, IntentKind, IntentRecord, Lease, RecordedIntents,
    Stale, StoredEvent,
};

use crate::db::{Announcement, Db, Row};
use crate::delegation::start_children;
use crate::events::{append_events, insert_events};
use crate::queue::absorb_steers;
use crate::rows::{
    from_json, parse_run_id, parse_session_id, parse_status, run_not_found, to_json,
};
use crate::runs::{
    RunRow, frozen_config, load_state, lock_session_of_run, pause_if_unclaimed, run_ended, run_row,
    set_pause_requested, write_encoded_state,
};
use crate::sessions::{encode_tool_calls, insert_encoded_message};
use crate::{Result, params};
use ratchet_store::step_message_id;

/// How a new job row starts: leased to the committer that continues with it (its first
/// claim, epoch 1), or free for any worker from `now`.
struct NewJob<'a> {
    attempt: u32,
    epoch: i64,
    owner: Option<&'a str>,
    ready_at: Millis,
}

impl<'a> NewJob<'a> {
    fn new(lease: Option<&'a Lease>, now: Millis) -> NewJob<'a> {
        match lease {
            Some(lease) => NewJob {
                attempt: 1,
                epoch: 1,
                owner: Some(&lease.owner),
                ready_at: lease.expires_at,
            },
            None => NewJob {
                attempt: 0,
                epoch: 0,
                owner: None,
                ready_at: now,
            },
        }
    }
}

pub(crate) fn insert_job(c: &dyn Db, job: &StepJob, now: Millis) -> Result<()> {
    insert_job_ready_at(c, job, now)
}

/// Inserts a job nobody holds that may be claimed from `ready_at` on (a timer's due time).
pub(crate) fn insert_job_ready_at(c: &dyn Db, job: &StepJob, ready_at: Millis) -> Result<()> {
    let row = NewJob::new(None, ready_at);
    c.execute(
        "INSERT INTO step_jobs (run_id, step_index, phase, attempt, epoch, lease_owner, ready_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        &params![
            job.run_id.as_str(),
            job.step_index as i64,
            job.phase.as_str(),
            row.attempt,
            row.epoch,
            row.owner,
            row.ready_at
        ],
    )?;
    c.announce(Announcement::JobsReady)
}

/// Moves the claimed job on to `next` (or deletes it). The caller has checked, holding the
/// job's row, that `claim` still holds it.
fn advance_job(c: &dyn Db, claim: &Claim, next: Option<&StepJob>, row: &NewJob<'_>) -> Result<()> {
    let (run_id, step_index) = (claim.run_id.as_str(), claim.step_index as i64);
    match next {
        None => c.write(
            "DELETE FROM step_jobs WHERE run_id = ?1 AND step_index = ?2 AND epoch = ?3",
            &params![run_id, step_index, claim.epoch],
        )?,
        Some(next) => c.write(
            "UPDATE step_jobs SET step_index = ?4, phase = ?5, attempt = ?6, epoch = ?7, lease_owner = ?8, ready_at = ?9
             WHERE run_id = ?1 AND step_index = ?2 AND epoch = ?3",
            &params![
                run_id,
                step_index,
                claim.epoch,
                next.step_index as i64,
                next.phase.as_str(),
                row.attempt,
                row.epoch,
                row.owner,
                row.ready_at
            ],
        )?,
    }
    if next.is_some() && row.owner.is_none() {
        c.announce(Announcement::JobsReady)?;
    }
    Ok(())
}

struct JobRow {
    step_index: u64,
    phase: String,
    attempt: u32,
    epoch: i64,
}

fn lease_job(c: &dyn Db, run_id: &RunId, job: JobRow, lease: &Lease) -> Result<ClaimedStep> {
    let attempt = job.attempt + 1;
    let epoch = job.epoch + 1;
    c.write(
        "UPDATE step_jobs SET attempt = ?3, epoch = ?4, lease_owner = ?5, ready_at = ?6
         WHERE run_id = ?1 AND step_index = ?2",
        &params![
            run_id.as_str(),
            job.step_index as i64,
            attempt,
            epoch,
            &lease.owner,
            lease.expires_at
        ],
    )?;
    let phase = Phase::parse(&job.phase)
        .ok_or_else(|| Error::Corrupt(format!("unknown phase {:?}", job.phase)))?;
    let state = load_state(c, run_id)?;
    Ok(ClaimedStep {
        job: StepJob {
            run_id: run_id.clone(),
            step_index: job.step_index,
            phase,
            attempt,
        },
        claim: Claim {
            run_id: run_id.clone(),
            step_index: job.step_index,
            epoch,
        },
        state,
        context: None,
    })
}

fn to_claimable(mut r: Row) -> Result<(String, JobRow)> {
    let run_id = r.text(0)?;
    let job = JobRow {
        step_index: r.int(1)? as u64,
        phase: r.text(2)?,
        attempt: u32::try_from(r.int(3)?)
            .map_err(|_| Error::Corrupt("a job's attempt is out of range".into()))?,
        epoch: r.int(4)?,
    };
    Ok((run_id, job))
}

/// How long a job whose run cannot be loaded is set aside before it is tried again.
const QUARANTINE_MS: Millis = 60_000;
/// Most unloadable jobs one claim sets aside before giving up until the next claim.
const MAX_SET_ASIDE: usize = 16;

pub(crate) fn claim_next(
    c: &dyn Db,
    lease: &Lease,
    run: Option<&RunId>,
    now: Millis,
) -> Result<Option<ClaimedStep>> {
    for _ in 0..MAX_SET_ASIDE {
        let found = match run {
            None => c.query_opt(
                &format!(
                    "SELECT run_id, step_index, phase, attempt, epoch FROM step_jobs
                     WHERE ready_at <= ?1 ORDER BY ready_at LIMIT 1{}",
                    c.skip_locked()
                ),
                &params![now],
            )?,
            Some(run) => c.query_opt(
                &format!(
                    "SELECT run_id, step_index, phase, attempt, epoch FROM step_jobs
                     WHERE run_id IN (SELECT id FROM runs WHERE id = ?1 OR root_run_id = ?1)
                       AND ready_at <= ?2 ORDER BY ready_at LIMIT 1{}",
                    c.skip_locked()
                ),
                &params![run.as_str(), now],
            )?,
        };
        let Some(found) = found else {
            return Ok(None);
        };
        let (run_id, job) = to_claimable(found)?;
        let step_index = job.step_index;
        c.write("SAVEPOINT claim", &[])?;
        let leased = parse_run_id(&run_id).and_then(|id| lease_job(c, &id, job, lease));
        match leased {
            Ok(claimed) => {
                c.write("RELEASE claim", &[])?;
                return Ok(Some(claimed));
            }
            Err(error) => {
                c.execute("ROLLBACK TO claim", &[])?;
                c.execute("RELEASE claim", &[])?;
                if !matches!(error, Error::Corrupt(_) | Error::NotFound { .. }) {
                    return Err(error);
                }
                // One unreadable run must not stop every worker: set its job aside.
                tracing::error!(run = %run_id, step = step_index, %error, "cannot load the run of a job; setting it aside");
                c.execute(
                    "UPDATE step_jobs SET ready_at = ?3 WHERE run_id = ?1 AND step_index = ?2",
                    &params![&run_id, step_index as i64, now + QUARANTINE_MS],
                )?;
            }
        }
    }
    Ok(None)
}

pub(crate) fn heartbeat(c: &dyn Db, claim: &Claim, expires_at: Millis) -> Result<bool> {
    let changed = c.execute(
        "UPDATE step_jobs SET ready_at = ?4 WHERE run_id = ?1 AND step_index = ?2 AND epoch = ?3",
        &params![
            claim.run_id.as_str(),
            claim.step_index as i64,
            claim.epoch,
            expires_at
        ],
    )?;
    Ok(changed == 1)
}

fn claim_holds(c: &dyn Db, claim: &Claim) -> Result<bool> {
    let epoch = c
        .query_opt(
            "SELECT epoch FROM step_jobs WHERE run_id = ?1 AND step_index = ?2",
            &params![claim.run_id.as_str(), claim.step_index as i64],
        )?
        .map(|mut r| r.int(0))
        .transpose()?;
    Ok(epoch == Some(claim.epoch))
}

/// What a commit reads besides the run's row, in the same statement: one round trip where
/// the database is across a network.
struct CommitView {
    /// The job's epoch now (its row held until the commit), if the job is still there.
    epoch: Option<i64>,
    /// The session's last event, which no one else can move while its lock is held.
    last_seq: i64,
    steers_waiting: bool,
    signals_waiting: bool,
}

fn commit_row(c: &dyn Db, claim: &Claim) -> Result<(RunRow, CommitView)> {
    let mut row = c
        .query_opt(
            &format!(
                "SELECT r.session_id, r.status, r.step_index, r.cancel_requested, r.pause_requested,
                        (SELECT epoch FROM step_jobs WHERE run_id = ?1 AND step_index = ?2{}),
                        s.last_seq,
                        EXISTS (SELECT 1 FROM steers WHERE session_id = r.session_id),
                        EXISTS (SELECT 1 FROM inbox WHERE session_id = r.session_id
                                  AND status = 'pending' AND delivery = 'steer')
                 FROM runs r JOIN sessions s ON s.id = r.session_id WHERE r.id = ?1",
                c.for_update()
            ),
            &params![claim.run_id.as_str(), claim.step_index as i64],
        )?
        .ok_or_else(|| run_not_found(&claim.run_id))?;
    let run = RunRow {
        session_id: parse_session_id(&row.text(0)?)?,
        status: parse_status(&row.text(1)?)?,
        step_index: row.int(2)? as u64,
        cancel_requested: row.flag(3)?,
        pause_requested: row.flag(4)?,
    };
    let view = CommitView {
        epoch: row.opt_int(5)?,
        last_seq: row.int(6)?,
        steers_waiting: row.flag(7)?,
        signals_waiting: row.flag(8)?,
    };
    Ok((run, view))
}

/// What a step's commit writes as JSON, encoded before its transaction: a writer that many
/// steps share (SQLite's one thread) then spends its time on the statements alone.
pub(crate) struct EncodedStep {
    state: String,
    summary: String,
    /// Each of the result's messages' tool calls.
    tool_calls: Vec<Option<String>>,
    /// Each of the result's events' payload.
    events: Vec<String>,
}

impl EncodedStep {
    pub(crate) fn of(result: &StepResult) -> Result<EncodedStep> {
        Ok(EncodedStep {
            state: to_json(&result.state)?,
            summary: to_json(&result.record.summary)?,
            tool_calls: result
                .messages
                .iter()
                .map(encode_tool_calls)
                .collect::<Result<_>>()?,
            events: result
                .events
                .iter()
                .map(|draft| crate::payload::encode(&draft.payload, Some(&result.state.run_id)))
                .collect::<Result<_>>()?,
        })
    }
}

pub(crate) fn commit_step(
    c: &dyn Db,
    claim: &Claim,
    mut result: StepResult,
    encoded: EncodedStep,
    continue_with: Option<Lease>,
    quota: ratchet_store::RunQuota,
    now: Millis,
) -> Result<Commit> {
    if result.record.index != claim.step_index || result.state.run_id != claim.run_id {
        return Err(Error::Conflict(format!(
            "result of {}#{} committed under the claim of {}#{}",
            result.state.run_id, result.record.index, claim.run_id, claim.step_index
        )));
    }
    lock_session_of_run(c, &claim.run_id)?;
    let (stored, seen) = commit_row(c, claim)?;
    if stored.cancel_requested {
        result.yield_to_cancel();
    }
    let paused = stored.pause_requested && result.yield_to_pause();
    // Input that arrived while the step ran ends the wait it parks on at once, as input
    // arriving after the commit would (it finds the run waiting; see `timer::wake_on_input`).
    let woken = result.state.status == RunStatus::WaitingTimer
        && result.state.lineage.is_none()
        && crate::inbox::pending_input(c, &stored.session_id, now)?
            .wakes(result.state.checkpoint.as_ref().and_then(|b| b.asked_at))
        && ratchet_core::timer::wake_by_input(&mut result.state, now);
    // A cancel, a pause or input that arrived during the step changed the result it was
    // encoded from.
    let encoded = if stored.cancel_requested || paused || woken {
        EncodedStep::of(&result)?
    } else {
        encoded
    };
    let refused = if stored.step_index + 1 != claim.step_index {
        Some(Stale::StepMismatch {
            committed: stored.step_index,
            job: claim.step_index,
        })
    } else {
        stored
            .status
            .edge(result.state.status)
            .err()
            .map(Stale::Edge)
    };
    // The fence: the claimed job becomes the next one (or goes) only while the claim's
    // epoch still holds it, and the row stays held until the commit.
    if seen.epoch != Some(claim.epoch) {
        return Ok(Commit::Stale(Stale::LeaseLost));
    }
    if let Some(refused) = refused {
        return Ok(Commit::Stale(refused));
    }
    // A run that waits on a timer is woken by its job at the due time, by whichever worker
    // is idle then: the job is nobody's, and the committer does not go on with it.
    let continue_with = continue_with.filter(|_| result.state.status != RunStatus::WaitingTimer);
    let ready_at = ratchet_core::timer::job_ready_at(&result.state, now);
    let next_row = NewJob::new(continue_with.as_ref(), ready_at);
    #[cfg(feature = "failpoints")]
    fail::fail_point!("commit.before_outbox", |_| injected("commit.before_outbox"));
    advance_job(c, claim, result.next.as_ref(), &next_row)?;
    #[cfg(feature = "failpoints")]
    fail::fail_point!("commit.after_outbox", |_| injected("commit.after_outbox"));
    let steer_boundary = result.accepts_steer();
    let state = &result.state;
    write_encoded_state(c, Some(stored.status), state, &encoded.state)?;
    if paused {
        set_pause_requested(c, &state.run_id, false)?;
    }
    if let Some(HumanRequest::Approval { approval_id, calls }) = &state.pending_human {
        let calls_json = to_json(calls)?;
        c.write(
            "INSERT INTO approvals (id, run_id, session_id, status, calls_json, created_at) VALUES (?1, ?2, ?3, 'pending', ?4, ?5)",
            &params![
                approval_id.as_str(),
                state.run_id.as_str(),
                stored.session_id.as_str(),
                &calls_json,
                now
            ],
        )?;
    }
    for (i, (message, tool_calls)) in result.messages.iter().zip(&encoded.tool_calls).enumerate() {
        let id = step_message_id(&state.run_id, claim.step_index, i);
        insert_encoded_message(c, &id, state, message, tool_calls.as_deref(), now)?;
    }
    let record = &result.record;
    c.write(
        "INSERT INTO steps (run_id, step_index, instruction, started_at, finished_at, summary_json) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        &params![
            state.run_id.as_str(),
            record.index as i64,
            &record.instruction,
            record.started_at,
            record.finished_at,
            &encoded.summary
        ],
    )?;
    let mut enqueued = result.next.is_some() && continue_with.is_none() && ready_at <= now;
    let mut drafts = std::mem::take(&mut result.events);
    let mut added = std::mem::take(&mut result.messages);
    if steer_boundary && seen.steers_waiting {
        drafts.extend(absorb_steers(c, &result.state, &mut added, now)?);
    }
    if steer_boundary && seen.signals_waiting {
        drafts.extend(crate::inbox::absorb_signals(
            c,
            &result.state,
            claim.step_index,
            &mut added,
            now,
        )?);
    }
    let mut events = append_events(
        c,
        &stored.session_id,
        Some(&claim.run_id),
        drafts,
        encoded.events,
        seen.last_seq,
        now,
    )?;
    if !result.children.is_empty() {
        events.extend(start_children(
            c,
            &result.state,
            &result.children,
            quota,
            now,
        )?);
        enqueued = true;
    }
    if result.state.status.is_terminal() {
        events.extend(run_ended(c, &result.state, &mut enqueued, now)?);
    }
    let continued = match (result.next, continue_with.is_some()) {
        (Some(next), true) => Some(ClaimedStep {
            claim: Claim {
                run_id: next.run_id.clone(),
                step_index: next.step_index,
                epoch: next_row.epoch,
            },
            job: StepJob { attempt: 1, ..next },
            // The state as a claim would load it: the frozen config and the store's cancel
            // flag, never the ones the result carried.
            state: AgentState {
                config: frozen_config(c, &claim.run_id)?,
                cancel_requested: stored.cancel_requested,
                pause_requested: stored.pause_requested,
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

/// What a commit transaction fails with where a failpoint is told to fail it: a database
/// error, so that the transaction keeps nothing and the worker gives the step back.
#[cfg(feature = "failpoints")]
fn injected<T>(failpoint: &str) -> Result<T> {
    Err(Error::Backend(format!("failpoint {failpoint}")))
}

pub(crate) fn retry_later(
    c: &dyn Db,
    claim: &Claim,
    available_at: Millis,
    event: EventDraft,
    now: Millis,
) -> Result<Option<Vec<StoredEvent>>> {
    lock_session_of_run(c, &claim.run_id)?;
    let released = c.execute(
        "UPDATE step_jobs SET lease_owner = NULL, ready_at = ?4
         WHERE run_id = ?1 AND step_index = ?2 AND epoch = ?3",
        &params![
            claim.run_id.as_str(),
            claim.step_index as i64,
            claim.epoch,
            available_at
        ],
    )?;
    if released == 0 {
        return Ok(None);
    }
    let stored = run_row(c, &claim.run_id)?;
    let mut events = insert_events(c, &stored.session_id, Some(&claim.run_id), &[event], now)?;
    // Waiting out a backoff is a step boundary too.
    if stored.pause_requested && stored.status == RunStatus::Running {
        events.extend(
            pause_if_unclaimed(c, &claim.run_id, &stored.session_id, now)?.unwrap_or_default(),
        );
    }
    Ok(Some(events))
}

pub(crate) fn fenced(c: &dyn Db, claim: &Claim) -> Result<()> {
    if claim_holds(c, claim)? {
        Ok(())
    } else {
        Err(Error::LeaseLost {
            run_id: claim.run_id.clone(),
            step_index: claim.step_index,
        })
    }
}

pub(crate) fn record_intents(
    c: &dyn Db,
    claim: &Claim,
    intents: &[Intent],
    events: &[EventDraft],
    now: Millis,
) -> Result<RecordedIntents> {
    lock_session_of_run(c, &claim.run_id)?;
    // The fence and the cancel check in one read: the claim must still hold the step, and
    // no cancel may have been accepted.
    let held = c.query_opt(
        "SELECT j.epoch, r.session_id, r.cancel_requested FROM step_jobs j JOIN runs r ON r.id = j.run_id
         WHERE j.run_id = ?1 AND j.step_index = ?2",
        &params![claim.run_id.as_str(), claim.step_index as i64],
    )?;
    let lost = || Error::LeaseLost {
        run_id: claim.run_id.clone(),
        step_index: claim.step_index,
    };
    let mut held = held.ok_or_else(lost)?;
    if held.int(0)? != claim.epoch {
        return Err(lost());
    }
    let session_id = parse_session_id(&held.text(1)?)?;
    if held.flag(2)? {
        return Err(Error::CancelRequested {
            run_id: claim.run_id.clone(),
        });
    }
    let mut attempts = Vec::with_capacity(intents.len());
    for intent in intents {
        let count = c
            .query_opt(
                "INSERT INTO intents (run_id, step_index, slot, kind, name, idempotency_key, attempts, started_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, 1, ?7)
                 ON CONFLICT (run_id, step_index, slot) DO UPDATE SET attempts = intents.attempts + 1, started_at = ?7
                 RETURNING attempts",
                &params![
                    claim.run_id.as_str(),
                    claim.step_index as i64,
                    intent.slot,
                    intent.kind.as_str(),
                    &intent.name,
                    &intent.idempotency_key,
                    now
                ],
            )?
            .ok_or_else(|| Error::Backend("recording an intent returned no row".into()))?
            .int(0)?;
        attempts.push(
            u32::try_from(count)
                .map_err(|_| Error::Corrupt("an intent's attempts are out of range".into()))?,
        );
    }
    let events = insert_events(c, &session_id, Some(&claim.run_id), events, now)?;
    Ok(RecordedIntents { events, attempts })
}

pub(crate) fn record_outcome(
    c: &dyn Db,
    claim: &Claim,
    slot: u32,
    outcome: &ToolOutcome,
    now: Millis,
) -> Result<()> {
    lock_session_of_run(c, &claim.run_id)?;
    fenced(c, claim)?;
    let outcome_json = to_json(outcome)?;
    let (run_id, step_index) = (&claim.run_id, claim.step_index);
    let changed = c.execute(
        "UPDATE intents SET outcome_json = ?4, finished_at = ?5 WHERE run_id = ?1 AND step_index = ?2 AND slot = ?3",
        &params![run_id.as_str(), step_index as i64, slot, &outcome_json, now],
    )?;
    if changed == 0 {
        return Err(Error::Conflict(format!(
            "no intent at {run_id}#{step_index}#{slot} to record an outcome for"
        )));
    }
    Ok(())
}

pub(crate) fn intents(c: &dyn Db, run_id: &RunId, step_index: u64) -> Result<Vec<IntentRecord>> {
    let out_of_range = |what: &str| Error::Corrupt(format!("an intent's {what} is out of range"));
    c.query(
        "SELECT slot, kind, name, attempts, outcome_json FROM intents WHERE run_id = ?1 AND step_index = ?2 ORDER BY slot",
        &params![run_id.as_str(), step_index as i64],
    )?
    .into_iter()
    .map(|mut r| {
        let kind = match r.text(1)?.as_str() {
            "model" => IntentKind::Model,
            "tool" => IntentKind::Tool,
            other => return Err(Error::Corrupt(format!("unknown intent kind {other:?}"))),
        };
        Ok(IntentRecord {
            slot: u32::try_from(r.int(0)?).map_err(|_| out_of_range("slot"))?,
            kind,
            name: r.text(2)?,
            attempts: u32::try_from(r.int(3)?).map_err(|_| out_of_range("attempts"))?,
            outcome: r
                .opt_text(4)?
                .map(|o| from_json(&o, "intent outcome"))
                .transpose()?,
        })
    })
    .collect()
}

pub(crate) fn steps(c: &dyn Db, run_id: &RunId) -> Result<Vec<StepRecord>> {
    c.query(
        "SELECT step_index, instruction, started_at, finished_at, summary_json FROM steps WHERE run_id = ?1 ORDER BY step_index",
        &params![run_id.as_str()],
    )?
    .into_iter()
    .map(|mut r| {
        Ok(StepRecord {
            index: r.int(0)? as u64,
            instruction: r.text(1)?,
            started_at: r.int(2)?,
            finished_at: r.int(3)?,
            summary: from_json(&r.text(4)?, "step summary")?,
        })
    })
    .collect()
}

pub(crate) fn lease_owners(c: &dyn Db) -> Result<Vec<String>> {
    c.query(
        "SELECT DISTINCT lease_owner FROM step_jobs WHERE lease_owner IS NOT NULL",
        &[],
    )?
    .into_iter()
    .map(|mut r| r.text(0))
    .collect()
}

pub(crate) fn release_leases(c: &dyn Db, owner: &str) -> Result<u64> {
    let released = c.execute(
        "UPDATE step_jobs SET lease_owner = NULL, ready_at = 0 WHERE lease_owner = ?1",
        &params![owner],
    )?;
    if released > 0 {
        c.announce(Announcement::JobsReady)?;
    }
    Ok(released)
}

pub(crate) fn runs_with_jobs(c: &dyn Db) -> Result<Vec<RunId>> {
    c.query("SELECT DISTINCT run_id FROM step_jobs", &[])?
        .into_iter()
        .map(|mut r| parse_run_id(&r.text(0)?))
        .collect()
}
