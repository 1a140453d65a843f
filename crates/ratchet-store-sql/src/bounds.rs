//! The steering lanes' caps, checked in the transaction that would add to a lane: what waits
//! is counted under the session's lock, so two steers racing for the last place cannot both
//! take it. The decision is the core's (`ratchet_core::bounds::admit_steer`).

use ratchet_core::bounds::{Queued, SteerLane, SteerLimits, admit_steer};
use ratchet_core::{RunId, SessionId};
use ratchet_store::Error;

use crate::db::Db;
use crate::runs::frozen_config;
use crate::{Result, params};

/// A user's steering message of `content` may join the queue of `active`, the session's
/// active run, under the caps that run was frozen with; refused with `SteerQueueFull`.
pub(crate) fn admit_user_steer(
    c: &dyn Db,
    session: &SessionId,
    active: &RunId,
    content: &str,
) -> Result<()> {
    let queued = queued(
        c,
        "SELECT content FROM steers WHERE session_id = ?1",
        session,
    )?;
    let limits = frozen_config(c, active)?.steer;
    let bytes = u64::try_from(content.len()).unwrap_or(u64::MAX);
    admit_steer(SteerLane::User, &limits, queued, bytes)
        .map_err(|why| Error::SteerQueueFull(format!("session {session}: {why}")))
}

/// A background run's steered signal of `payload_bytes` may wait for the root session's next
/// model call, under the caps frozen with `limits`; the refusal is for the model that sent it.
pub(crate) fn admit_agent_steer(
    c: &dyn Db,
    root: &SessionId,
    limits: &SteerLimits,
    payload_bytes: usize,
) -> Result<Result<(), String>> {
    let queued = queued(
        c,
        "SELECT payload_json FROM inbox WHERE session_id = ?1 AND status = 'pending' AND delivery = 'steer'",
        root,
    )?;
    let payload_bytes = u64::try_from(payload_bytes).unwrap_or(u64::MAX);
    Ok(admit_steer(SteerLane::Agent, limits, queued, payload_bytes))
}

/// What one lane of `session` holds: each row's first column is a waiting message's text.
fn queued(c: &dyn Db, sql: &str, session: &SessionId) -> Result<Queued> {
    let sizes = (c.query(sql, &params![session.as_str()])?.into_iter())
        .map(|mut row| Ok(row.text(0)?.len()))
        .collect::<Result<Vec<_>>>()?;
    Ok(Queued::of_sizes(sizes))
}
