//! Forking a run: the source read as its step left it, the fork written — its session, its
//! copy of the history, its run and first job — as the SQL backends do, in one write.

use ratchet_core::fork::{self, ForkedFrom, Source};
use ratchet_core::{Message, Millis, Role};
use ratchet_store::{
    Forked, NewFork, Result, SessionSpec, batch_started, batch_steps, source_messages,
    step_message_id,
};
use serde_json::json;

use crate::tables::{Tables, run_not_found};

impl Tables {
    pub(crate) fn fork_run(&mut self, new: NewFork, now: Millis) -> Result<Forked> {
        let source = self.load_state(&new.source)?;
        let session = self.get_session(&source.session_id)?;
        if session.deleted_at.is_some() {
            return Err(run_not_found(&new.source));
        }
        let records = self.steps(&new.source);
        let tagged = source_messages(self.stored_history(&source.session_id), &new.source);
        let positions: Vec<i64> = tagged.iter().map(|(p, _)| *p).collect();
        let history =
            fork::history_through(tagged.iter().map(|(_, m)| m.clone()).collect(), new.at_step);
        let mut started = std::collections::HashMap::new();
        if let Some(batch) = fork::pending_batch_step(&history) {
            for step in batch_steps(&tagged, batch, source.step_index) {
                started.extend(batch_started(self.intents(&new.source, step)));
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
        self.check_quota(&new.session_id, new.quota, 1)?;
        let spec = SessionSpec {
            tenant: session.tenant.clone(),
            agent,
            metadata: session.metadata.clone(),
            request: None,
        };
        self.create_session(&new.session_id, spec, now)?;
        let ids: Vec<String> = (0..plan.messages.len())
            .map(|i| step_message_id(&new.run_id, 0, i))
            .collect();
        let input = (plan.messages.iter().zip(&ids)).rfind(|((_, m), _)| m.role == Role::User);
        let (input_id, input_text) = input
            .map_or((String::new(), String::new()), |((_, m), id)| {
                (id.clone(), m.content.clone())
            });
        let (state, mut created) = self.insert_queued_run(
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
        self.session_mut(&new.session_id)?.title = session.title.clone();
        // Positions are dense here: the copies take the next ones, in order.
        let first = i64::try_from(self.messages.len()).unwrap_or(i64::MAX) + 1;
        for (at, ((_, message), id)) in plan.messages.iter().zip(&ids).enumerate() {
            let keeps_from = message.keeps_from.map(|from| {
                let kept =
                    (plan.messages.iter()).position(|(source, _)| positions[*source] >= from);
                first + i64::try_from(kept.unwrap_or(at)).unwrap_or_default()
            });
            let message = Message {
                keeps_from,
                ..message.clone()
            };
            self.insert_message(id, &state, message, now)?;
        }
        let started = fork::start(
            &plan,
            new.session_id.clone(),
            new.run_id.clone(),
            config,
            forked_from,
            now,
        );
        self.write_state(&started.state)?;
        if let Some(job) = &started.job {
            self.insert_job(job, now)?;
        }
        self.session_mut(&new.session_id)?.active_run_id = Some(new.run_id.clone());
        let mut drafts = vec![created];
        drafts.extend(started.events);
        let events = self.insert_events(&new.session_id, Some(&new.run_id), drafts, now)?;
        Ok(Forked {
            session: self.get_session(&new.session_id)?,
            status: started.state.status,
            events,
        })
    }
}
