//! Forking a run: the one transaction that reads the source as its step left it and writes
//! the fork — its session, its copy of the history, its run and first job. The source is only
//! read; what the fork is decided in `ratchet_core::fork`.

use ratchet_core::fork::{self, ForkedFrom, Source};
use ratchet_core::{Millis, Role};
use ratchet_store::{
    Effect, Forked, NewFork, SessionSpec, batch_started, batch_steps, source_messages,
    step_message_id,
};
use serde_json::json;

use crate::db::Db;
use crate::events::insert_events;
use crate::queue::{check_quota, insert_queued_run};
use crate::rows::run_not_found;
use crate::runs::{load_state, lock_session_of_run, write_state};
use crate::sessions::{create_session, get_session, insert_message, stored_history};
use crate::steps::{insert_job, intents, steps};
use crate::{Result, params};

pub(crate) fn fork_run(c: &dyn Db, new: NewFork, now: Millis) -> Result<Forked> {
    // The source's session lock keeps its intents still while they are read: a `never` call
    // of the source cannot record its outcome between this read and the fork's commit.
    lock_session_of_run(c, &new.source)?;
    let source = load_state(c, &new.source)?;
    let session = get_session(c, &source.session_id)?;
    if session.deleted_at.is_some() {
        return Err(run_not_found(&new.source));
    }
    let records = steps(c, &new.source)?;
    let tagged = source_messages(stored_history(c, &source.session_id)?, &new.source);
    let positions: Vec<i64> = tagged.iter().map(|(p, _)| *p).collect();
    let history =
        fork::history_through(tagged.iter().map(|(_, m)| m.clone()).collect(), new.at_step);
    let mut started = std::collections::HashMap::new();
    if let Some(batch) = fork::pending_batch_step(&history) {
        for step in batch_steps(&tagged, batch, source.step_index) {
            started.extend(batch_started(intents(c, &new.source, step)?));
        }
    }
    let (config, agent) = match new.config {
        Some((config, agent)) => (config, agent),
        None => (source.config.as_ref().clone(), session.agent.clone()),
    };
    let plan = fork::plan(
        &Source {
            run_id: &new.source,
            committed: source.step_index,
            continuation: source.config.continuation,
            step: records.iter().find(|r| r.index == new.at_step),
            history: &history,
            started: &started,
            state: &source,
        },
        new.at_step,
        new.edit.as_ref(),
    )?;
    check_quota(c, &new.session_id, new.quota, 1)?;
    let spec = SessionSpec {
        tenant: session.tenant.clone(),
        agent,
        metadata: session.metadata.clone(),
        request: None,
    };
    create_session(c, &new.session_id, spec, now)?;
    let ids: Vec<String> = (0..plan.messages.len())
        .map(|i| step_message_id(&new.run_id, 0, i))
        .collect();
    // The run's input is the last user message of its history, as it reads in the fork.
    let input = (plan.messages.iter().zip(&ids)).rfind(|((_, m), _)| m.role == Role::User);
    let (input_id, input_text) = input.map_or((String::new(), String::new()), |((_, m), id)| {
        (id.clone(), m.content.clone())
    });
    let (state, mut created) = insert_queued_run(
        c,
        &new.session_id,
        &new.run_id,
        &input_id,
        &input_text,
        config.clone(),
        None,
        now,
    )?;
    let forked_from = ForkedFrom {
        run_id: new.source.clone(),
        step: new.at_step,
    };
    created.payload["forked_from"] = json!(forked_from);
    c.write(
        "UPDATE runs SET forked_from_run_id = ?2, forked_from_step = ?3 WHERE id = ?1",
        &params![new.run_id.as_str(), new.source.as_str(), new.at_step as i64],
    )?;
    c.execute(
        "UPDATE sessions SET title = ?2 WHERE id = ?1",
        &params![new.session_id.as_str(), &session.title],
    )?;
    for (((_, message), id), keeps) in plan.messages.iter().zip(&ids).zip(kept(&plan, &positions)) {
        // A summary names the first message it keeps by position: the copy's, set below.
        let message = ratchet_core::Message {
            keeps_from: keeps.map(|_| 0),
            ..message.clone()
        };
        insert_message(c, id, &state, &message, now)?;
    }
    for (id, keeps) in ids.iter().zip(kept(&plan, &positions)) {
        let Some(keeps) = keeps else { continue };
        c.execute(
            "UPDATE messages SET keeps_from = (SELECT rowid FROM messages WHERE id = ?2) WHERE id = ?1",
            &params![id.as_str(), ids[keeps].as_str()],
        )?;
    }
    let started = fork::start(
        &plan,
        new.session_id.clone(),
        new.run_id.clone(),
        config,
        forked_from,
        now,
    );
    write_state(c, &started.state)?;
    if let Some(job) = &started.job {
        insert_job(c, job, now)?;
    }
    c.execute(
        "UPDATE sessions SET active_run_id = ?2 WHERE id = ?1",
        &params![new.session_id.as_str(), new.run_id.as_str()],
    )?;
    let mut drafts = vec![created];
    drafts.extend(started.events);
    let events = insert_events(c, &new.session_id, Some(&new.run_id), &drafts, now)?;
    if let Some(mark) = &new.request {
        let effect = Effect::Forked {
            source: new.source.clone(),
            at_step: new.at_step,
            session_id: new.session_id.clone(),
            run_id: new.run_id.clone(),
            status: started.state.status,
        };
        crate::requests::record_effect(c, mark, &effect)?;
    }
    Ok(Forked {
        session: get_session(c, &new.session_id)?,
        status: started.state.status,
        events,
    })
}

/// For each message the plan copies, the index among the copies of the first message it
/// keeps when it is a summary: the first copy at or after the position it named.
fn kept<'a>(
    plan: &'a fork::ForkPlan,
    positions: &'a [i64],
) -> impl Iterator<Item = Option<usize>> + 'a {
    (plan.messages.iter().enumerate()).map(move |(at, (_, message))| {
        let from = message.keeps_from?;
        let kept = (plan.messages.iter()).position(|(source, _)| positions[*source] >= from);
        Some(kept.unwrap_or(at))
    })
}
