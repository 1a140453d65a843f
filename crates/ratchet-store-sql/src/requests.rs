//! Idempotent requests: taking a key (`RequestClaim::decide` says how), recording a keyed
//! request's effect inside that request's own transaction, keeping its response, giving a
//! key back, and sweeping expired keys.

use ratchet_core::Millis;
use ratchet_store::{
    Effect, Error, KeyRecord, KeyedRequest, RequestClaim, RequestMark, StoredResponse,
};

use crate::db::Db;
use crate::rows::{from_json, to_json};
use crate::{Result, params};

pub(crate) fn begin_request(
    c: &dyn Db,
    request: KeyedRequest,
    now: Millis,
) -> Result<RequestClaim> {
    let key = &request.key;
    let record = c
        .query_opt(
            "SELECT method, path, body_hash, attempt, held_until, expires_at, effect_json,
                    response_status, response_body
             FROM idempotent_requests WHERE tenant = ?1 AND idempotency_key = ?2",
            &params![&key.tenant, &key.key],
        )?
        .map(|mut row| -> Result<KeyRecord> {
            let effect = row.opt_text(6)?;
            let status = row.opt_int(7)?;
            let body = row.opt_text(8)?;
            Ok(KeyRecord {
                method: row.text(0)?,
                path: row.text(1)?,
                body_hash: row.text(2)?,
                attempt: row.int(3)?,
                held_until: row.int(4)?,
                expires_at: row.int(5)?,
                effect: effect
                    .map(|json| from_json(&json, "a request's effect"))
                    .transpose()?,
                response: match (status, body) {
                    (Some(status), Some(body)) => Some(StoredResponse {
                        status: u16::try_from(status).map_err(|_| {
                            Error::Corrupt(format!(
                                "response status {status} is not an HTTP status"
                            ))
                        })?,
                        body,
                    }),
                    _ => None,
                },
            })
        })
        .transpose()?;
    let (claim, taken) = RequestClaim::decide(record.as_ref(), &request, now);
    let Some(attempt) = taken else {
        return Ok(claim);
    };
    let held_until = request.held_until;
    let written = match &record {
        None => c.execute(
            "INSERT INTO idempotent_requests (tenant, idempotency_key, method, path, body_hash,
                 attempt, held_until, expires_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
             ON CONFLICT (tenant, idempotency_key) DO NOTHING",
            &params![
                &key.tenant,
                &key.key,
                &request.method,
                &request.path,
                &request.body_hash,
                attempt,
                held_until,
                request.expires_at
            ],
        )?,
        // Taken over (the holder is presumed dead) or expired: the row is claimed only if
        // nobody else claimed it since it was read.
        Some(record) => {
            let expired = record.expires_at <= now;
            c.execute(
                "UPDATE idempotent_requests
                 SET method = ?3, path = ?4, body_hash = ?5, attempt = ?6, held_until = ?7,
                     expires_at = CASE WHEN ?9 = 1 THEN ?8 ELSE expires_at END,
                     effect_json = CASE WHEN ?9 = 1 THEN NULL ELSE effect_json END,
                     response_status = CASE WHEN ?9 = 1 THEN NULL ELSE response_status END,
                     response_body = CASE WHEN ?9 = 1 THEN NULL ELSE response_body END
                 WHERE tenant = ?1 AND idempotency_key = ?2 AND attempt = ?10",
                &params![
                    &key.tenant,
                    &key.key,
                    &request.method,
                    &request.path,
                    &request.body_hash,
                    attempt,
                    held_until,
                    request.expires_at,
                    expired,
                    record.attempt
                ],
            )?
        }
    };
    if written == 0 {
        // Another request took the key between the read and the write.
        return Ok(RequestClaim::InProgress { held_until });
    }
    Ok(claim)
}

/// Records what a keyed request's transaction did, in that transaction; refuses (and so
/// rolls the transaction back) when the mark no longer holds the key.
pub(crate) fn record_effect(c: &dyn Db, mark: &RequestMark, effect: &Effect) -> Result<()> {
    let recorded = c.execute(
        "UPDATE idempotent_requests SET effect_json = ?4
         WHERE tenant = ?1 AND idempotency_key = ?2 AND attempt = ?3
           AND response_status IS NULL",
        &params![
            &mark.key.tenant,
            &mark.key.key,
            mark.attempt,
            &to_json(effect)?
        ],
    )?;
    if recorded == 0 {
        return Err(taken_over(mark));
    }
    Ok(())
}

pub(crate) fn taken_over(mark: &RequestMark) -> Error {
    Error::Conflict(format!(
        "the request with Idempotency-Key {:?} no longer holds its key (attempt {}): a repeat \
         took it over; nothing was done",
        mark.key.key, mark.attempt
    ))
}

pub(crate) fn finish_request(
    c: &dyn Db,
    mark: &RequestMark,
    response: &StoredResponse,
) -> Result<bool> {
    let kept = c.execute(
        "UPDATE idempotent_requests SET response_status = ?4, response_body = ?5
         WHERE tenant = ?1 AND idempotency_key = ?2 AND attempt = ?3
           AND response_status IS NULL",
        &params![
            &mark.key.tenant,
            &mark.key.key,
            mark.attempt,
            i64::from(response.status),
            &response.body
        ],
    )?;
    Ok(kept == 1)
}

pub(crate) fn abandon_request(c: &dyn Db, mark: &RequestMark) -> Result<()> {
    c.execute(
        "DELETE FROM idempotent_requests
         WHERE tenant = ?1 AND idempotency_key = ?2 AND attempt = ?3
           AND response_status IS NULL AND effect_json IS NULL",
        &params![&mark.key.tenant, &mark.key.key, mark.attempt],
    )?;
    Ok(())
}

pub(crate) fn sweep_requests(c: &dyn Db, now: Millis) -> Result<u64> {
    c.execute(
        "DELETE FROM idempotent_requests WHERE expires_at <= ?1",
        &params![now],
    )
}
