//! A root session's inbox: places reserved when background work is admitted, reports written
//! when background runs end, signals, continuation turns that lease due events and consume
//! them when they complete, operators' dead-letter actions, and closing a session.
//!
//! Every status change goes through `move_events`, which asks the core's edge table first.

use ratchet_core::delegation::{ChildResult, ChildRun, completion_report};
use ratchet_core::inbox::{
    DueEvent, EXPIRED, EarlierSignal, InboxRoom, NextTurn, RUN_CANCELLED, SESSION_CLOSED,
    SignalAdmission, Waiting, admit_signal, continuation_config, continuation_ids,
    continuation_release_reason, continuation_trigger, dead_lettered, next_turn, places_to_reserve,
    signal_not_sent, signal_to_closed, steered_signal, trigger_budget,
};
use ratchet_core::{
    AgentState, CompletionPolicy, Delivery, EventDraft, EventKind, InboxKind, InboxPolicy,
    InboxStatus, Message, Millis, Origin, RunId, RunStatus, SessionId, Visibility,
};
use ratchet_store::{
    CancelOutcome, Claim, Closed, Closing, DeadLetterAction, EmittedSignal, Error, InboxChange,
    InboxEvent, NewSignal, PendingInput, Result, SignalOutcome, StoredEvent,
};
use serde_json::{Value, json};

use crate::tables::{InboxRow, Tables, session_not_found};

/// Most events one continuation turn is handed.
const EVENTS_PER_TURN: usize = 32;
/// Most pending reports one pass of `expire` dead-letters.
const EXPIRED_PER_PASS: usize = 256;
/// Most sessions one pass of `servable_sessions` offers.
const SERVED_PER_PASS: usize = 64;

impl Tables {
    /// Events and reservations a root session's inbox holds.
    pub(crate) fn held(&self, root_session: &SessionId) -> u64 {
        let held =
            (self.inbox.iter()).filter(|e| e.session_id == *root_session && e.status.is_held());
        u64::try_from(held.count()).unwrap_or(u64::MAX)
    }

    /// Moves the events `ids` that are still `from` to `to`, noting `reason` when given.
    /// Returns the ids that moved.
    fn move_events(
        &mut self,
        ids: &[i64],
        from: InboxStatus,
        to: InboxStatus,
        reason: Option<&str>,
        now: Millis,
    ) -> Result<Vec<i64>> {
        from.edge(to)
            .map_err(|e| Error::Conflict(format!("inbox: {e}")))?;
        let mut moved = Vec::new();
        for &id in ids {
            if let Some(event) = self.inbox_event_mut(id).filter(|e| e.status == from) {
                event.status = to;
                if let Some(reason) = reason {
                    event.reason = Some(reason.to_owned());
                }
                event.updated_at = now;
                moved.push(id);
            }
        }
        Ok(moved)
    }

    /// The ids of the inbox's events that `wanted` picks, oldest first.
    fn ids_where(&self, wanted: impl Fn(&InboxRow) -> bool) -> Vec<i64> {
        (self.inbox_rows())
            .filter(|(_, e)| wanted(e))
            .map(|(id, _)| id)
            .collect()
    }

    fn push_event(&mut self, event: InboxRow) -> i64 {
        self.inbox.push(event);
        i64::try_from(self.inbox.len()).unwrap_or(i64::MAX)
    }

    fn is_closed(&self, session: &SessionId) -> bool {
        self.sessions.get(session).is_some_and(|s| s.is_closed())
    }

    /// The inbox rules an event follows: those frozen with the run that delegated its work.
    fn policy_of(&self, delegated_by: &RunId) -> Result<InboxPolicy> {
        Ok(self.run(delegated_by)?.config.delegation.inbox)
    }

    /// Reserves the inbox places the background children of a parent's step will report to:
    /// one per child (`each`) or one per group (`all`). Refused with `Error::QuotaExceeded`
    /// when the root session's inbox has no room for them all.
    pub(crate) fn reserve(
        &mut self,
        parent: &AgentState,
        children: &[ChildRun],
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        let Some((root, places)) = places_to_reserve(children) else {
            return Ok(Vec::new());
        };
        let policy = parent.config.delegation.inbox;
        (InboxRoom::new(root, self.held(root), &policy).reserve(places.len()))
            .map_err(Error::QuotaExceeded)?;
        let mut drafts = Vec::new();
        for place in places {
            let (kind, source, group) = (place.kind, place.source, place.group);
            let id = self.push_event(InboxRow {
                session_id: root.clone(),
                kind,
                status: InboxStatus::Reserved,
                delivery: Delivery::Queue,
                parent_run_id: parent.run_id.clone(),
                source_run_id: source.cloned(),
                group: Some(group.to_owned()),
                payload: None,
                call_key: None,
                dedupe_key: None,
                attempts: 0,
                max_attempts: policy.max_attempts,
                available_at: None,
                lease_run_id: None,
                reason: None,
                requeued_at: None,
                expires_at: None,
                created_at: now,
                updated_at: now,
            });
            drafts.push(EventDraft::new(
                EventKind::InboxReserved,
                json!({"event": id, "kind": kind, "source_run_id": source, "group": group, "delegated_by": parent.run_id}),
            ));
        }
        self.insert_events(root, None, drafts, now)
    }

    /// A background run has ended: if it was cancelled, its unread signals are superseded;
    /// its report fills its reserved place — its own (`each`), or its group's once the group's
    /// last run has ended (`all`) — and, when the root session is free, a continuation turn
    /// starts with it.
    pub(crate) fn background_ended(
        &mut self,
        child: &AgentState,
        enqueued: &mut bool,
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        let Some(lineage) = &child.lineage else {
            return Ok(Vec::new());
        };
        let Some(group) = &lineage.background else {
            return Ok(Vec::new());
        };
        let root = &lineage.root_session_id;
        let mut events = Vec::new();
        if child.status == RunStatus::Cancelled {
            let unread = self.ids_where(|e| {
                e.source_run_id.as_ref() == Some(&child.run_id)
                    && e.kind == InboxKind::Signal
                    && e.status == InboxStatus::Pending
            });
            let superseded = self.move_events(
                &unread,
                InboxStatus::Pending,
                InboxStatus::Superseded,
                Some(RUN_CANCELLED),
                now,
            )?;
            if !superseded.is_empty() {
                let draft = EventDraft::new(
                    EventKind::InboxSuperseded,
                    json!({"events": superseded, "source_run_id": child.run_id}),
                );
                events.extend(self.insert_events(root, None, vec![draft], now)?);
            }
        }
        let (place, results) = match group.policy {
            CompletionPolicy::Each => (
                self.ids_where(|e| {
                    e.source_run_id.as_ref() == Some(&child.run_id)
                        && e.kind == InboxKind::Completion
                        && e.status == InboxStatus::Reserved
                }),
                ChildResult::of(child).into_iter().collect(),
            ),
            CompletionPolicy::All => {
                let mut members: Vec<(u64, &RunId)> = (self.runs.iter())
                    .filter(|(_, run)| run.inbox_group() == Some(group.group.as_str()))
                    .map(|(id, run)| (run.created_order, id))
                    .collect();
                members.sort();
                if members.iter().any(|(_, id)| {
                    self.runs
                        .get(*id)
                        .is_some_and(|r| !r.status().is_terminal())
                }) {
                    return Ok(events);
                }
                let mut results = Vec::new();
                for (_, member) in &members {
                    results.extend(ChildResult::of(&self.load_state(member)?));
                }
                (
                    self.ids_where(|e| {
                        e.group.as_deref() == Some(group.group.as_str())
                            && e.kind == InboxKind::GroupCompletion
                            && e.status == InboxStatus::Reserved
                    }),
                    results,
                )
            }
        };
        let report = completion_report(&lineage.parent_run_id, results);
        let closed = self.is_closed(root);
        let expires_at = self.policy_of(&lineage.parent_run_id)?.expires_at(now);
        let mut drafts = Vec::new();
        for id in place {
            if let Some(event) = self.inbox_event_mut(id) {
                event.payload = Some(report.clone());
                event.available_at = Some(now);
                event.expires_at = Some(expires_at);
            }
            if closed {
                let dead = self.move_events(
                    &[id],
                    InboxStatus::Reserved,
                    InboxStatus::DeadLetter,
                    Some(SESSION_CLOSED),
                    now,
                )?;
                drafts.push(dead_lettered(&dead, SESSION_CLOSED));
            } else {
                self.move_events(
                    &[id],
                    InboxStatus::Reserved,
                    InboxStatus::Pending,
                    None,
                    now,
                )?;
                drafts.push(EventDraft::new(
                    EventKind::InboxPending,
                    json!({"event": id, "kind": group.policy.report_kind(), "source_run_id": child.run_id}),
                ));
            }
        }
        events.extend(self.insert_events(root, None, drafts, now)?);
        if !closed {
            events.extend(self.serve_if_free(root, enqueued, now)?);
        }
        Ok(events)
    }

    /// An inbox event became due in a root session: one that has no active run starts a
    /// continuation turn; one whose active run waits on a timer wakes it.
    fn serve_if_free(
        &mut self,
        session: &SessionId,
        enqueued: &mut bool,
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        let free = (self.sessions.get(session))
            .is_some_and(|s| s.active_run_id.is_none() && !s.is_closed());
        if self.due(session, now).next().is_none() {
            return Ok(Vec::new());
        }
        // A report is input for a busy session's run, as it is for `sleep`: a wait on a timer
        // ends now.
        if !free {
            if self.wake_on_input(session, now)?.is_some() {
                *enqueued = true;
            }
            return Ok(Vec::new());
        }
        *enqueued = true;
        self.start_continuation(session, now)
    }

    /// The session's pending events due by `now`, with their ids, oldest first.
    fn due<'a>(
        &'a self,
        session: &'a SessionId,
        now: Millis,
    ) -> impl Iterator<Item = (i64, &'a InboxRow)> + 'a {
        self.inbox_rows().filter(move |(_, e)| {
            e.session_id == *session
                && e.status == InboxStatus::Pending
                && e.available_at.is_some_and(|at| at <= now)
        })
    }

    /// What a freed session does next (see `ratchet_core::inbox::next_turn`, under the rules
    /// of the event due longest): the oldest queued user run, a continuation turn, or nothing.
    /// A closed session starts nothing.
    pub(crate) fn choose_next_turn(
        &self,
        session: &SessionId,
        queued_user: bool,
        now: Millis,
    ) -> Result<NextTurn> {
        let row = self.session(session)?;
        if row.is_closed() {
            return Ok(NextTurn::Idle);
        }
        let oldest = (self.due(session, now))
            .min_by_key(|(id, e)| (e.available_at, *id))
            .map(|(_, e)| (e.available_at, &e.parent_run_id));
        let policy = match oldest {
            Some((_, delegated_by)) => self.policy_of(delegated_by)?,
            None => InboxPolicy::default(),
        };
        let waiting = Waiting {
            queued_user,
            oldest_due: oldest.and_then(|(due, _)| due),
            user_turns_in_a_row: row.user_turns_in_a_row,
        };
        Ok(next_turn(waiting, &policy, now))
    }

    /// Starts a continuation run in a free root session: its due events (oldest first) are
    /// leased to it, and it starts with a hidden trigger that carries their reports.
    pub(crate) fn start_continuation(
        &mut self,
        session: &SessionId,
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        let due = (self.due(session, now))
            .take(EVENTS_PER_TURN)
            .map(|(id, e)| {
                let due = DueEvent {
                    id,
                    kind: e.kind,
                    payload: reported(id, e)?.clone(),
                };
                Ok((due, e.attempts))
            })
            .collect::<Result<Vec<_>>>()?;
        let Some((first, attempts)) = due.first() else {
            return Ok(Vec::new());
        };
        let latest = (self.runs.iter())
            .filter(|(_, run)| run.session_id == *session)
            .max_by(|(a_id, a), (b_id, b)| {
                (a.state.created_at, a_id).cmp(&(b.state.created_at, b_id))
            })
            .ok_or_else(|| {
                Error::Corrupt(format!("session {session} has inbox events but no run"))
            })?;
        let config = continuation_config(&latest.1.config);
        let (run_id, message_id) = continuation_ids(now, first.id, i64::from(*attempts))
            .map_err(|e| Error::Corrupt(e.to_string()))?;
        let events: Vec<DueEvent> = due.into_iter().map(|(e, _)| e).collect();
        // The turn takes the events its trigger carries; the rest wait for the next one.
        let (trigger, carried) = continuation_trigger(&events, trigger_budget(&config.limits));
        let events = &events[..carried];
        let (state, created) = self.insert_queued_run(
            session,
            &run_id,
            message_id.as_str(),
            &trigger,
            config,
            None,
            now,
        )?;
        let ids: Vec<i64> = events.iter().map(|e| e.id).collect();
        let leased =
            self.move_events(&ids, InboxStatus::Pending, InboxStatus::Leased, None, now)?;
        for &id in &leased {
            if let Some(event) = self.inbox_event_mut(id) {
                event.lease_run_id = Some(run_id.clone());
                event.attempts += 1;
            }
        }
        let mut drafts = vec![created];
        drafts.extend(self.start_queued_run(state, now)?);
        drafts.push(EventDraft::new(
            EventKind::InboxLeased,
            json!({"events": leased, "run_id": run_id}),
        ));
        self.insert_events(session, Some(&run_id), drafts, now)
    }

    /// A continuation run has ended: the events it held are consumed when it completed; when
    /// it failed each goes back to pending for a later attempt (or to the dead letter after
    /// its last). When someone stopped it they go back to pending without the attempt
    /// counting, held for the session's next user turn (`wake_held`).
    pub(crate) fn continuation_ended(
        &mut self,
        state: &AgentState,
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        let run = &state.run_id;
        let held: Vec<(i64, u32, RunId)> = (self.inbox_rows())
            .filter(|(_, e)| {
                e.lease_run_id.as_ref() == Some(run) && e.status == InboxStatus::Leased
            })
            .map(|(id, e)| (id, e.attempts, e.parent_run_id.clone()))
            .collect();
        let ids: Vec<i64> = held.iter().map(|(id, _, _)| *id).collect();
        let mut drafts = Vec::new();
        match state.status {
            RunStatus::Completed => {
                // The turn's messages join the session's history in the write that consumes
                // what they tell; a failed or stopped attempt leaves its drafts out of it.
                for message in &mut self.messages {
                    if message.session_id == state.session_id
                        && message.draft_of.as_ref() == Some(run)
                    {
                        message.draft_of = None;
                    }
                }
                let consumed =
                    self.move_events(&ids, InboxStatus::Leased, InboxStatus::Consumed, None, now)?;
                drafts.push(EventDraft::new(
                    EventKind::InboxConsumed,
                    json!({"events": consumed, "run_id": run}),
                ));
            }
            RunStatus::Cancelled => {
                let reason = continuation_release_reason(run, state.status, state.stop_reason);
                let given_back = self.move_events(
                    &ids,
                    InboxStatus::Leased,
                    InboxStatus::Pending,
                    Some(&reason),
                    now,
                )?;
                for &id in &given_back {
                    if let Some(event) = self.inbox_event_mut(id) {
                        event.attempts = event.attempts.saturating_sub(1);
                        event.available_at = None;
                    }
                }
                if !given_back.is_empty() {
                    let released: Vec<Value> = (given_back.iter())
                        .map(|id| json!({"event": id, "available_at": null}))
                        .collect();
                    drafts.push(EventDraft::new(
                        EventKind::InboxReleased,
                        json!({"events": released, "run_id": run, "reason": reason}),
                    ));
                }
            }
            _ => {
                let reason = continuation_release_reason(run, state.status, state.stop_reason);
                let (mut released, mut dead) = (Vec::new(), Vec::new());
                for (id, attempts, delegated_by) in held {
                    match self.policy_of(&delegated_by)?.retry_at(attempts, now) {
                        Some(at) => {
                            self.move_events(
                                &[id],
                                InboxStatus::Leased,
                                InboxStatus::Pending,
                                Some(&reason),
                                now,
                            )?;
                            if let Some(event) = self.inbox_event_mut(id) {
                                event.available_at = Some(at);
                            }
                            released.push(json!({"event": id, "available_at": at}));
                        }
                        None => dead.extend(self.move_events(
                            &[id],
                            InboxStatus::Leased,
                            InboxStatus::DeadLetter,
                            Some(&reason),
                            now,
                        )?),
                    }
                }
                if !released.is_empty() {
                    drafts.push(EventDraft::new(
                        EventKind::InboxReleased,
                        json!({"events": released, "run_id": run, "reason": reason}),
                    ));
                }
                if !dead.is_empty() {
                    drafts.push(dead_lettered(&dead, &reason));
                }
            }
        }
        self.insert_events(&state.session_id, Some(run), drafts, now)
    }

    /// A user turn starts in `session`: the events a stopped continuation gave back become
    /// due, so the continuation after this turn tells them.
    pub(crate) fn wake_held(&mut self, session: &SessionId, now: Millis) {
        for event in &mut self.inbox {
            if event.session_id == *session
                && event.status == InboxStatus::Pending
                && event.available_at.is_none()
            {
                event.available_at = Some(now);
            }
        }
    }

    /// Dead-letters the pending reports that have outlived their max age (`expired`), at
    /// most `EXPIRED_PER_PASS`.
    pub(crate) fn expire(&mut self, now: Millis) -> Result<Vec<StoredEvent>> {
        let mut expired: Vec<(SessionId, i64)> = (self.inbox_rows())
            .filter(|(_, e)| {
                e.status == InboxStatus::Pending && e.expires_at.is_some_and(|at| at <= now)
            })
            .map(|(id, e)| (e.session_id.clone(), id))
            .collect();
        expired.sort();
        expired.truncate(EXPIRED_PER_PASS);
        let mut by_session: Vec<(SessionId, Vec<i64>)> = Vec::new();
        for (session, id) in expired {
            match by_session.last_mut() {
                Some((last, ids)) if *last == session => ids.push(id),
                _ => by_session.push((session, vec![id])),
            }
        }
        let reason = EXPIRED;
        let mut events = Vec::new();
        for (session, ids) in by_session {
            let dead = self.move_events(
                &ids,
                InboxStatus::Pending,
                InboxStatus::DeadLetter,
                Some(reason),
                now,
            )?;
            if !dead.is_empty() {
                let draft = dead_lettered(&dead, reason);
                events.extend(self.insert_events(&session, None, vec![draft], now)?);
            }
        }
        Ok(events)
    }

    /// Root sessions a continuation could start in now.
    pub(crate) fn servable_sessions(&self, now: Millis) -> Vec<SessionId> {
        let mut sessions: Vec<SessionId> = (self.inbox.iter())
            .filter(|e| {
                e.status == InboxStatus::Pending
                    && e.available_at.is_some_and(|at| at <= now)
                    && (self.sessions.get(&e.session_id))
                        .is_some_and(|s| s.active_run_id.is_none() && !s.is_closed())
            })
            .map(|e| e.session_id.clone())
            .collect();
        sessions.sort();
        sessions.dedup();
        sessions.truncate(SERVED_PER_PASS);
        sessions
    }

    /// Starts a continuation in `session` if it is still free with due events; returns its
    /// events and the run it started.
    pub(crate) fn serve_session(
        &mut self,
        session: &SessionId,
        now: Millis,
    ) -> Result<(Vec<StoredEvent>, Option<RunId>)> {
        let mut enqueued = false;
        let events = self.serve_if_free(session, &mut enqueued, now)?;
        let started = (self.sessions.get(session))
            .and_then(|s| s.active_run_id.clone())
            .filter(|_| enqueued);
        Ok((events, started))
    }

    pub(crate) fn close_session(
        &mut self,
        session: &SessionId,
        how: Closing,
        now: Millis,
    ) -> Result<Closed> {
        let row = (self.sessions.get_mut(session))
            .filter(|row| row.deleted_at.is_none())
            .ok_or_else(|| session_not_found(session))?;
        if let Some(root) = &row.root_session_id {
            return Err(Error::Invalid(format!(
                "session {session} holds a delegated run; close its root session {root}"
            )));
        }
        if how == Closing::Archive && row.archived_at.is_some() {
            return Err(Error::Conflict(format!(
                "session {session} is already archived"
            )));
        }
        row.archived_at = row.archived_at.or(Some(now));
        row.deleted_at = (how == Closing::Delete).then_some(now);
        // Waiting steers are user messages: they stay on record, as runs cancelled with the
        // rest.
        for steer in self.take_steers(session) {
            self.insert_queued_run(
                session,
                &steer.run_id,
                &steer.message_id,
                &steer.content,
                steer.config,
                None,
                steer.created_at,
            )?;
        }
        let mut unfinished: Vec<(u32, Millis, &RunId)> = (self.runs.iter())
            .filter(|(_, run)| {
                !run.status().is_terminal()
                    && (run.session_id == *session
                        || (self.sessions.get(&run.session_id))
                            .is_some_and(|s| s.root_session_id.as_ref() == Some(session)))
            })
            .map(|(id, run)| (run.depth(), run.state.created_at, id))
            .collect();
        unfinished.sort();
        let unfinished: Vec<RunId> = unfinished
            .into_iter()
            .map(|(_, _, id)| id.clone())
            .collect();
        let mut events = Vec::new();
        let mut enqueued = false;
        for run in unfinished {
            match self.cancel_one(&run, now)? {
                CancelOutcome::Cancelled {
                    events: more,
                    enqueued: more_enqueued,
                } => {
                    events.extend(more);
                    enqueued |= more_enqueued;
                }
                CancelOutcome::Cancelling { events: more } => events.extend(more),
                CancelOutcome::AlreadyTerminal(_) => {}
            }
        }
        let reason = format!("the session was {}", how.as_str());
        let mut drafts = Vec::new();
        for from in [
            InboxStatus::Reserved,
            InboxStatus::Pending,
            InboxStatus::Leased,
        ] {
            let ids = self.ids_where(|e| e.session_id == *session && e.status == from);
            let dead = self.move_events(&ids, from, InboxStatus::DeadLetter, Some(&reason), now)?;
            if !dead.is_empty() {
                drafts.push(dead_lettered(&dead, &reason));
            }
        }
        drafts.push(EventDraft::new(
            EventKind::SessionClosed,
            json!({"session_id": session, "how": how.as_str()}),
        ));
        events.extend(self.insert_events(session, None, drafts, now)?);
        Ok(Closed { events, enqueued })
    }

    /// A root session's inbox events in order, after `after`, with the given status only when
    /// given.
    pub(crate) fn inbox(
        &self,
        session: &SessionId,
        status: Option<InboxStatus>,
        after: i64,
        limit: u32,
    ) -> Vec<InboxEvent> {
        (self.inbox_rows())
            .filter(|(id, e)| {
                e.session_id == *session && *id > after && status.is_none_or(|s| e.status == s)
            })
            .take(limit as usize)
            .map(|(id, e)| view(id, e))
            .collect()
    }

    /// See `Writes::act_on_dead_letter`.
    pub(crate) fn act_on_dead_letter(
        &mut self,
        session: &SessionId,
        id: i64,
        action: DeadLetterAction,
        by: &str,
        now: Millis,
    ) -> Result<InboxChange> {
        let event = self.session_event(session, id)?;
        if !action.applies_to(&event)? {
            return Ok(InboxChange {
                event,
                events: Vec::new(),
                enqueued: false,
            });
        }
        let reason = action.reason(by, &event);
        let (dead, to) = (InboxStatus::DeadLetter, action.target());
        let kind = match action {
            DeadLetterAction::Requeue => {
                if self.is_closed(session) {
                    return Err(DeadLetterAction::closed(session));
                }
                let policy = self.policy_of(&event.parent_run_id)?;
                (InboxRoom::new(session, self.held(session), &policy).requeue(id))
                    .map_err(Error::QuotaExceeded)?;
                self.move_events(&[id], dead, to, Some(&reason), now)?;
                if let Some(event) = self.inbox_event_mut(id) {
                    event.attempts = 0;
                    event.available_at = Some(now);
                    event.requeued_at = Some(now);
                    event.expires_at = Some(policy.expires_at(now));
                    event.lease_run_id = None;
                }
                EventKind::InboxRequeued
            }
            DeadLetterAction::Discard => {
                self.move_events(&[id], dead, to, Some(&reason), now)?;
                EventKind::InboxDiscarded
            }
        };
        let told = EventDraft::new(kind, json!({"events": [id], "by": by}));
        let mut events = self.insert_events(session, None, vec![told], now)?;
        let mut enqueued = false;
        if action == DeadLetterAction::Requeue {
            events.extend(self.serve_if_free(session, &mut enqueued, now)?);
        }
        Ok(InboxChange {
            event: self.session_event(session, id)?,
            events,
            enqueued,
        })
    }

    /// The event `id` of `session`'s inbox, as it stands.
    fn session_event(&self, session: &SessionId, id: i64) -> Result<InboxEvent> {
        (self.inbox_event(id))
            .filter(|e| e.session_id == *session)
            .map(|e| view(id, e))
            .ok_or_else(|| Error::NotFound {
                kind: "inbox event",
                id: format!("{id} of session {session}"),
            })
    }

    pub(crate) fn emit_signal(
        &mut self,
        claim: &Claim,
        signal: NewSignal,
        now: Millis,
    ) -> Result<EmittedSignal> {
        self.fenced(claim)?;
        let state = self.load_state(&claim.run_id)?;
        if state.cancel_requested {
            return Err(Error::CancelRequested {
                run_id: claim.run_id.clone(),
            });
        }
        let (Some(lineage), Some(contract)) = (&state.lineage, &state.config.signal) else {
            return Ok(refused(
                "only a background run whose agent has a signal contract may send signals".into(),
            ));
        };
        if lineage.background.is_none() {
            return Ok(refused(
                "only a background run may send signals; a foreground run reports in its answer"
                    .into(),
            ));
        }
        if let Some((id, _)) = (self.inbox_rows())
            .find(|(_, e)| e.call_key.as_deref() == Some(signal.call_key.as_str()))
        {
            return Ok(duplicate_signal(id));
        }
        let earlier: Vec<EarlierSignal> = (self.inbox_rows())
            .filter(|(_, e)| {
                e.source_run_id.as_ref() == Some(&claim.run_id) && e.kind == InboxKind::Signal
            })
            .map(|(id, e)| EarlierSignal {
                event: id,
                dedupe_key: e.dedupe_key.clone().unwrap_or_default(),
                created_at: e.created_at,
            })
            .collect();
        match admit_signal(contract, &earlier, &signal.dedupe_key, now) {
            SignalAdmission::Accept => {}
            SignalAdmission::Duplicate(id) => return Ok(duplicate_signal(id)),
            SignalAdmission::Refuse(why) => return Ok(refused(why)),
        }
        let root = &lineage.root_session_id;
        if self.is_closed(root) {
            return Ok(refused(signal_to_closed(root)));
        }
        let policy = self.policy_of(&lineage.parent_run_id)?;
        if let Err(why) = InboxRoom::new(root, self.held(root), &policy).signal() {
            return Ok(refused(why));
        }
        if contract.delivery == Delivery::Steer {
            let limits = self.run(&lineage.parent_run_id)?.config.steer;
            let bytes = signal.payload.to_string().len();
            if let Err(why) = self.admit_agent_steer(root, &limits, bytes) {
                return Ok(refused(signal_not_sent(&why)));
            }
        }
        let id = self.push_event(InboxRow {
            session_id: root.clone(),
            kind: InboxKind::Signal,
            status: InboxStatus::Pending,
            delivery: contract.delivery,
            parent_run_id: lineage.parent_run_id.clone(),
            source_run_id: Some(claim.run_id.clone()),
            group: None,
            payload: Some(signal.payload.clone()),
            call_key: Some(signal.call_key),
            dedupe_key: Some(signal.dedupe_key),
            attempts: 0,
            max_attempts: policy.max_attempts,
            available_at: Some(now),
            lease_run_id: None,
            reason: None,
            requeued_at: None,
            expires_at: Some(policy.expires_at(now)),
            created_at: now,
            updated_at: now,
        });
        let drafts = vec![
            EventDraft::new(
                EventKind::SignalEmitted,
                json!({"event": id, "source_run_id": claim.run_id, "delivery": contract.delivery, "signal": signal.payload}),
            ),
            EventDraft::new(
                EventKind::InboxPending,
                json!({"event": id, "kind": InboxKind::Signal, "source_run_id": claim.run_id}),
            ),
        ];
        let mut events = self.insert_events(root, None, drafts, now)?;
        let mut enqueued = false;
        events.extend(self.serve_if_free(root, &mut enqueued, now)?);
        Ok(EmittedSignal {
            outcome: SignalOutcome::Sent(id),
            events,
            enqueued,
        })
    }

    /// The root session's run reaches a model call: the steered signals waiting for it join
    /// its history now, hidden, and are consumed by it.
    pub(crate) fn absorb_signals(
        &mut self,
        state: &AgentState,
        step_index: u64,
        added: &mut Vec<Message>,
        now: Millis,
    ) -> Result<Vec<EventDraft>> {
        if state.lineage.is_some() {
            return Ok(Vec::new());
        }
        let waiting = (self.inbox_rows())
            .filter(|(_, e)| {
                e.session_id == state.session_id
                    && e.status == InboxStatus::Pending
                    && e.delivery == Delivery::Steer
            })
            .map(|(id, e)| Ok((id, reported(id, e)?.clone())))
            .collect::<Result<Vec<_>>>()?;
        if waiting.is_empty() {
            return Ok(Vec::new());
        }
        for (id, payload) in &waiting {
            let message = Message {
                visibility: Visibility::Hidden,
                origin: Origin::Steer,
                ..Message::user(steered_signal(payload))
            };
            let message_id =
                ratchet_store::step_message_id(&state.run_id, step_index, format!("s{id}"));
            self.insert_message(&message_id, state, message.clone(), now)?;
            added.push(message);
        }
        let ids: Vec<i64> = waiting.iter().map(|(id, _)| *id).collect();
        let consumed =
            self.move_events(&ids, InboxStatus::Pending, InboxStatus::Consumed, None, now)?;
        for &id in &consumed {
            if let Some(event) = self.inbox_event_mut(id) {
                event.lease_run_id = Some(state.run_id.clone());
            }
        }
        Ok(vec![EventDraft::new(
            EventKind::InboxConsumed,
            json!({"events": consumed, "run_id": state.run_id, "steered": true}),
        )])
    }

    pub(crate) fn pending_input(&self, session: &SessionId, now: Millis) -> PendingInput {
        let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        PendingInput {
            queued_messages: count(
                (self.runs.values())
                    .filter(|run| {
                        run.session_id == *session
                            && run.status() == RunStatus::Queued
                            && run.state.created_at <= now
                    })
                    .count(),
            ),
            steers: count(
                (self.steers.iter())
                    .filter(|s| s.session_id == *session && s.created_at <= now)
                    .count(),
            ),
            inbox_events: count(self.due(session, now).count()),
            newest_queued_at: (self.runs.values())
                .filter(|run| {
                    run.session_id == *session
                        && run.status() == RunStatus::Queued
                        && run.state.created_at <= now
                })
                .map(|run| run.state.created_at)
                .max(),
            newest_due_at: (self.due(session, now))
                .filter_map(|(_, e)| e.available_at)
                .max(),
        }
    }
}

/// What a pending event reports; only a reservation has nothing yet.
fn reported(id: i64, event: &InboxRow) -> Result<&Value> {
    (event.payload.as_ref())
        .ok_or_else(|| Error::Corrupt(format!("inbox event {id} is due with nothing to report")))
}

fn refused(why: String) -> EmittedSignal {
    EmittedSignal {
        outcome: SignalOutcome::Refused(why),
        events: Vec::new(),
        enqueued: false,
    }
}

fn duplicate_signal(id: i64) -> EmittedSignal {
    EmittedSignal {
        outcome: SignalOutcome::Duplicate(id),
        events: Vec::new(),
        enqueued: false,
    }
}

fn view(id: i64, e: &InboxRow) -> InboxEvent {
    InboxEvent {
        id,
        session_id: e.session_id.clone(),
        kind: e.kind,
        status: e.status,
        delivery: e.delivery,
        parent_run_id: e.parent_run_id.clone(),
        source_run_id: e.source_run_id.clone(),
        group: e.group.clone(),
        payload: e.payload.clone(),
        attempts: e.attempts,
        max_attempts: e.max_attempts,
        available_at: e.available_at,
        lease_run_id: e.lease_run_id.clone(),
        reason: e.reason.clone(),
        requeued_at: e.requeued_at,
        expires_at: e.expires_at,
        created_at: e.created_at,
        updated_at: e.updated_at,
    }
}
