//! Step permits: how many model calls and tool calls may be in flight at once, in the whole
//! process and per session tree.
//!
//! A permit is taken around the call itself — never across a wait for a human or for children
//! — global first, then the session's, and released in reverse. A run waiting for its
//! children holds no job and therefore no permit, so a tree of any depth completes with one
//! permit: at every instant the only runs that want one are the ones doing a call, and none
//! of them waits for anything else while holding it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ratchet_core::SessionId;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Concurrent calls allowed; None means no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PermitLimits {
    pub model_calls: Option<usize>,
    pub model_calls_per_session: Option<usize>,
    pub tool_calls: Option<usize>,
    pub tool_calls_per_session: Option<usize>,
}

/// The model-call and tool-call gates of one process.
#[derive(Debug, Default)]
pub struct StepPermits {
    model: Gate,
    tool: Gate,
}

impl StepPermits {
    pub fn new(limits: PermitLimits) -> StepPermits {
        StepPermits {
            model: Gate::new(limits.model_calls, limits.model_calls_per_session),
            tool: Gate::new(limits.tool_calls, limits.tool_calls_per_session),
        }
    }

    /// Waits for a model-call permit of `session` (a tree's root session).
    pub async fn model_call(&self, session: &SessionId) -> Permit<'_> {
        self.model.acquire(session).await
    }

    /// Waits for a tool-call permit of `session` (a tree's root session).
    pub async fn tool_call(&self, session: &SessionId) -> Permit<'_> {
        self.tool.acquire(session).await
    }
}

#[derive(Debug, Default)]
struct Gate {
    global: Option<Arc<Semaphore>>,
    per_session: Option<usize>,
    /// Only sessions with a call in flight or waiting have an entry (see `Permit::drop`).
    sessions: Mutex<HashMap<SessionId, Arc<Semaphore>>>,
}

impl Gate {
    fn new(global: Option<usize>, per_session: Option<usize>) -> Gate {
        Gate {
            // A configured limit may be any integer; a semaphore holds at most MAX_PERMITS.
            global: global.map(|n| Arc::new(Semaphore::new(n.clamp(1, Semaphore::MAX_PERMITS)))),
            per_session: per_session.map(|n| n.clamp(1, Semaphore::MAX_PERMITS)),
            sessions: Mutex::new(HashMap::new()),
        }
    }

    async fn acquire(&self, session: &SessionId) -> Permit<'_> {
        let global = match &self.global {
            Some(semaphore) => Arc::clone(semaphore).acquire_owned().await.ok(),
            None => None,
        };
        let session_permit = match self.per_session {
            Some(n) => {
                let semaphore = {
                    let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
                    Arc::clone(
                        sessions
                            .entry(session.clone())
                            .or_insert_with(|| Arc::new(Semaphore::new(n))),
                    )
                };
                semaphore.acquire_owned().await.ok()
            }
            None => None,
        };
        Permit {
            gate: self,
            session: session.clone(),
            session_permit,
            _global: global,
        }
    }
}

/// Held while a call runs. Dropping it gives the session's permit back, then the global one.
#[derive(Debug)]
pub struct Permit<'a> {
    gate: &'a Gate,
    session: SessionId,
    session_permit: Option<OwnedSemaphorePermit>,
    _global: Option<OwnedSemaphorePermit>,
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        let Some(permit) = self.session_permit.take() else {
            return;
        };
        drop(permit);
        // The map's entry goes when nobody else holds or waits on it: whoever does holds a
        // clone, taken under this same lock.
        let mut sessions = self.gate.sessions.lock().unwrap_or_else(|e| e.into_inner());
        if sessions
            .get(&self.session)
            .is_some_and(|semaphore| Arc::strong_count(semaphore) == 1)
        {
            sessions.remove(&self.session);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn session(name: &str) -> SessionId {
        SessionId::from_suffix(name).unwrap()
    }

    #[tokio::test]
    async fn a_session_waits_for_its_own_permit_and_others_go_on() {
        let permits = StepPermits::new(PermitLimits {
            model_calls: Some(2),
            model_calls_per_session: Some(1),
            ..PermitLimits::default()
        });
        let (a, b, c) = (session("a"), session("b"), session("c"));
        let soon = Duration::from_millis(50);
        let held = permits.model_call(&a).await;
        let same = tokio::time::timeout(soon, permits.model_call(&a)).await;
        assert!(same.is_err(), "a second call of one session waits");
        let other = tokio::time::timeout(soon, permits.model_call(&b)).await;
        let other = other.expect("another session's call goes on");
        let third = tokio::time::timeout(soon, permits.model_call(&c)).await;
        assert!(third.is_err(), "the global limit of two holds");
        drop(held);
        drop(other);
        let again = tokio::time::timeout(soon, permits.model_call(&a)).await;
        assert!(again.is_ok(), "released permits are taken again");
    }

    #[tokio::test]
    async fn a_released_session_leaves_no_entry_behind() {
        let permits = StepPermits::new(PermitLimits {
            tool_calls_per_session: Some(1),
            ..PermitLimits::default()
        });
        for i in 0..100 {
            let permit = permits.tool_call(&session(&format!("s{i}"))).await;
            drop(permit);
        }
        assert!(permits.tool.sessions.lock().unwrap().is_empty());
        let held = permits.tool_call(&session("x")).await;
        assert_eq!(permits.tool.sessions.lock().unwrap().len(), 1);
        drop(held);
        assert!(permits.tool.sessions.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_limit_beyond_what_a_semaphore_holds_is_no_limit_in_practice() {
        let permits = StepPermits::new(PermitLimits {
            model_calls: Some(usize::MAX),
            model_calls_per_session: Some(usize::MAX),
            ..PermitLimits::default()
        });
        let a = session("a");
        let held: Vec<_> = futures::future::join_all((0..10).map(|_| permits.model_call(&a))).await;
        assert_eq!(held.len(), 10);
    }

    #[tokio::test]
    async fn no_limits_never_wait() {
        let permits = StepPermits::default();
        let a = session("a");
        let held: Vec<_> = futures::future::join_all((0..50).map(|_| permits.model_call(&a))).await;
        assert_eq!(held.len(), 50);
    }
}
