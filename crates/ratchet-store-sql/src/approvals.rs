//! Approvals: reading them (a pending one whose run no longer waits reads as cancelled; a
//! run's end writes it cancelled) and answering one, which moves its run on.

use ratchet_core::{ApprovalAnswer, ApprovalId, Millis, RunStatus};
use ratchet_store::{Answered, Approval, ApprovalStatus, Error};

use crate::db::{Db, Row};
use crate::events::insert_events;
use crate::rows::{corrupt, from_json, parse_run_id, parse_session_id, to_json};
use crate::runs::{load_state, mark_cancel_requested, run_ended, write_state};
use crate::steps::insert_job;
use crate::{Result, params};

const APPROVAL_COLUMNS: &str = "a.id, a.run_id, a.session_id, a.status, r.status, a.calls_json, a.answer_json, a.created_at, a.decided_at";

fn to_approval(mut r: Row) -> Result<Approval> {
    let status = r.text(3)?;
    let mut status = ApprovalStatus::parse(&status)
        .ok_or_else(|| Error::Corrupt(format!("unknown approval status {status:?}")))?;
    if status == ApprovalStatus::Pending && r.text(4)? != RunStatus::WaitingHuman.as_str() {
        status = ApprovalStatus::Cancelled;
    }
    Ok(Approval {
        id: ApprovalId::parse(&r.text(0)?).map_err(corrupt)?,
        run_id: parse_run_id(&r.text(1)?)?,
        session_id: parse_session_id(&r.text(2)?)?,
        status,
        calls: from_json(&r.text(5)?, "approval calls")?,
        answer: r
            .opt_text(6)?
            .map(|a| from_json(&a, "approval answer"))
            .transpose()?,
        created_at: r.int(7)?,
        decided_at: r.opt_int(8)?,
    })
}

pub(crate) fn approvals(
    c: &dyn Db,
    tenant: &str,
    status: Option<ApprovalStatus>,
    after: Option<&ApprovalId>,
    limit: u32,
) -> Result<Vec<Approval>> {
    // A pending row is pending only while its run waits; otherwise it reads as cancelled (a
    // run's end writes that, but a run that moved on without ending leaves the row pending).
    let filter = match status {
        None => "",
        Some(ApprovalStatus::Pending) => "AND a.status = 'pending' AND r.status = 'waiting_human'",
        Some(ApprovalStatus::Cancelled) => {
            "AND (a.status = 'cancelled' OR (a.status = 'pending' AND r.status <> 'waiting_human'))"
        }
        Some(ApprovalStatus::Decided) => "AND a.status = 'decided'",
        Some(ApprovalStatus::Aborted) => "AND a.status = 'aborted'",
    };
    let sql = format!(
        "SELECT {APPROVAL_COLUMNS} FROM approvals a
         JOIN runs r ON r.id = a.run_id
         JOIN sessions s ON s.id = a.session_id
         WHERE s.tenant = ?1
           AND a.position > COALESCE((SELECT position FROM approvals WHERE id = ?2), 0)
           {filter}
         ORDER BY a.position LIMIT ?3"
    );
    c.query(&sql, &params![tenant, after.map(ApprovalId::as_str), limit])?
        .into_iter()
        .map(to_approval)
        .collect()
}

pub(crate) fn get_approval(c: &dyn Db, id: &ApprovalId) -> Result<Approval> {
    let row = c
        .query_opt(
            &format!(
                "SELECT {APPROVAL_COLUMNS} FROM approvals a JOIN runs r ON r.id = a.run_id WHERE a.id = ?1"
            ),
            &params![id.as_str()],
        )?
        .ok_or_else(|| approval_not_found(id))?;
    to_approval(row)
}

fn approval_not_found(id: &ApprovalId) -> Error {
    Error::NotFound {
        kind: "approval",
        id: id.to_string(),
    }
}

pub(crate) fn answer_approval(
    c: &dyn Db,
    id: &ApprovalId,
    answer: ApprovalAnswer,
    by: &str,
    now: Millis,
) -> Result<Answered> {
    let session = c
        .query_opt(
            "SELECT session_id FROM approvals WHERE id = ?1",
            &params![id.as_str()],
        )?
        .ok_or_else(|| approval_not_found(id))?
        .text(0)?;
    c.lock_session(&session)?;
    let approval = get_approval(c, id)?;
    let answer = answer.normalized();
    if let Some(repeat) = approval.answered_again(&answer)? {
        return Ok(repeat);
    }
    let mut state = load_state(c, &approval.run_id)?;
    let (drafts, job) = ratchet_core::approval::answer_approval(&mut state, id, &answer, by, now)?;
    write_state(c, &state)?;
    let status = match answer {
        ApprovalAnswer::Abort => ApprovalStatus::Aborted,
        ApprovalAnswer::Decisions(_) => ApprovalStatus::Decided,
    };
    let answer_json = to_json(&answer)?;
    c.execute(
        "UPDATE approvals SET status = ?2, answer_json = ?3, decided_at = ?4 WHERE id = ?1",
        &params![id.as_str(), status.as_str(), &answer_json, now],
    )?;
    if let Some(job) = &job {
        insert_job(c, job, now)?;
    }
    let mut events = insert_events(c, &state.session_id, Some(&state.run_id), &drafts, now)?;
    let mut enqueued = false;
    if state.status.is_terminal() {
        mark_cancel_requested(c, &state.run_id)?;
        events.extend(run_ended(c, &state, &mut enqueued, now)?);
    }
    Ok(Answered {
        events,
        resumed: job.is_some(),
        enqueued,
        repeated: false,
    })
}
