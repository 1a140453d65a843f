//! Sessions: created once, read with what their runs and events say of them, listed per
//! tenant (delegated runs' sessions and deleted ones left out) and renamed.

use ratchet_core::{Millis, Role, RunStatus, SessionId, Visibility};
use ratchet_store::{
    Error, ListOrder, Result, Session, SessionCursor, SessionQuery, SessionSpec, SessionState,
};

use crate::tables::{SessionRow, Tables, session_not_found};

impl Tables {
    pub(crate) fn create_session(
        &mut self,
        id: &SessionId,
        spec: SessionSpec,
        now: Millis,
    ) -> Result<Session> {
        if self.sessions.contains_key(id) {
            return Err(Error::Conflict(format!("session {id} already exists")));
        }
        self.sessions.insert(
            id.clone(),
            SessionRow {
                tenant: spec.tenant,
                agent: spec.agent,
                metadata: spec.metadata,
                created_at: now,
                active_run_id: None,
                archived_at: None,
                deleted_at: None,
                title: None,
                parent_session_id: None,
                root_session_id: None,
                user_turns_in_a_row: 0,
                events: Vec::new(),
            },
        );
        self.get_session(id)
    }

    pub(crate) fn get_session(&self, id: &SessionId) -> Result<Session> {
        Ok(self.session_view(id, self.session(id)?))
    }

    /// A session as read: its own fields, its active run's status, when it was last active
    /// and how its latest run (run ids are time-ordered) stands.
    fn session_view(&self, id: &SessionId, row: &SessionRow) -> Session {
        let status_of = |run| self.runs.get(run).map(|r| r.status());
        let latest_run = (self.runs.iter())
            .filter(|(_, run)| run.session_id == *id)
            .map(|(run_id, _)| run_id)
            .next_back();
        Session {
            id: id.clone(),
            tenant: row.tenant.clone(),
            agent: row.agent.clone(),
            metadata: row.metadata.clone(),
            created_at: row.created_at,
            active_run_id: row.active_run_id.clone(),
            archived_at: row.archived_at,
            deleted_at: row.deleted_at,
            active_run_status: row.active_run_id.as_ref().and_then(status_of),
            last_activity_at: row.events.last().map_or(row.created_at, |e| e.created_at),
            title: row.title.clone(),
            last_run_status: latest_run.and_then(status_of),
            parent_session_id: row.parent_session_id.clone(),
        }
    }

    pub(crate) fn list_sessions(
        &self,
        tenant: &str,
        query: &SessionQuery,
        limit: u32,
    ) -> Result<Vec<Session>> {
        let text = query.text.as_ref().map(|t| t.to_lowercase());
        let mut found: Vec<Session> = (self.sessions.iter())
            .filter(|(_, row)| {
                row.tenant == tenant && row.root_session_id.is_none() && row.deleted_at.is_none()
            })
            .map(|(id, row)| self.session_view(id, row))
            .filter(|session| query.state.is_none_or(|state| in_state(session, state)))
            .filter(|session| (query.agent.as_ref()).is_none_or(|agent| session.agent == *agent))
            .filter(|session| {
                query
                    .created_from
                    .is_none_or(|from| session.created_at >= from)
            })
            .filter(|session| {
                (query.created_before).is_none_or(|before| session.created_at < before)
            })
            .filter(|session| (text.as_deref()).is_none_or(|text| self.mentions(session, text)))
            .collect();
        let latest_first = |a: &Session, b: &Session| {
            (b.last_activity_at, &b.id).cmp(&(a.last_activity_at, &a.id))
        };
        match (query.order, &query.after) {
            (ListOrder::OldestFirst, None) => {}
            (ListOrder::OldestFirst, Some(SessionCursor::Id(after))) => {
                found.retain(|s| s.id > *after);
            }
            (ListOrder::NewestFirst, None) => found.reverse(),
            (ListOrder::NewestFirst, Some(SessionCursor::Id(after))) => {
                found.reverse();
                found.retain(|s| s.id < *after);
            }
            (ListOrder::LatestActivityFirst, None) => found.sort_by(latest_first),
            (ListOrder::LatestActivityFirst, Some(SessionCursor::Activity(at, after))) => {
                found.sort_by(latest_first);
                found.retain(|s| (s.last_activity_at, &s.id) < (*at, after));
            }
            (order, Some(cursor)) => {
                return Err(Error::Invalid(format!(
                    "a cursor of a list in {order:?} order, found {cursor:?}"
                )));
            }
        }
        found.truncate(limit as usize);
        Ok(found)
    }

    /// Whether `text` (lowercase) is in the session's id, its title or a visible user or
    /// assistant message of it, in any case.
    fn mentions(&self, session: &Session, text: &str) -> bool {
        let has = |haystack: &str| haystack.to_lowercase().contains(text);
        has(session.id.as_str())
            || has(session.title.as_deref().unwrap_or_default())
            || self.messages.iter().any(|m| {
                m.session_id == session.id
                    && m.draft_of.is_none()
                    && m.message.visibility == Visibility::Visible
                    && matches!(m.message.role, Role::User | Role::Assistant)
                    && has(&m.message.content)
            })
    }

    pub(crate) fn rename_session(&mut self, id: &SessionId, title: &str) -> Result<Session> {
        let row = self
            .sessions
            .get_mut(id)
            .filter(|row| row.deleted_at.is_none())
            .ok_or_else(|| session_not_found(id))?;
        row.title = Some(title.to_owned());
        self.get_session(id)
    }
}

fn in_state(session: &Session, state: SessionState) -> bool {
    let open = session.archived_at.is_none();
    let idle = session.active_run_status.is_none();
    match state {
        SessionState::Archived => !open,
        SessionState::WaitingHuman => {
            open && session.active_run_status == Some(RunStatus::WaitingHuman)
        }
        SessionState::Active => {
            open && !idle && session.active_run_status != Some(RunStatus::WaitingHuman)
        }
        SessionState::Failed => open && idle && session.last_run_status == Some(RunStatus::Failed),
        SessionState::Idle => open && idle && session.last_run_status != Some(RunStatus::Failed),
    }
}
