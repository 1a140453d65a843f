//! The history `memory_search` looks through: the store's message search, scoped as the run's
//! frozen config says (its session, or every session of its tenant). Read-only.

use std::sync::Arc;

use async_trait::async_trait;
use ratchet_core::{MemoryScope, SessionId};
use ratchet_store::{Reads, SearchScope};
use ratchet_tools::{MemoryHit, MemorySearch};

pub(crate) struct StoreMemory {
    store: Arc<dyn Reads>,
    scope: MemoryScope,
}

impl std::fmt::Debug for StoreMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreMemory")
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

impl StoreMemory {
    pub(crate) fn new(store: Arc<dyn Reads>, scope: MemoryScope) -> StoreMemory {
        StoreMemory { store, scope }
    }
}

#[async_trait]
impl MemorySearch for StoreMemory {
    async fn search(
        &self,
        session: &SessionId,
        query: &str,
        limit: u32,
    ) -> Result<Vec<MemoryHit>, String> {
        let scope = match self.scope {
            MemoryScope::Session => SearchScope::Session(session.clone()),
            MemoryScope::Tenant => {
                let session = self.store.get_session(session).await.map_err(failed)?;
                SearchScope::Tenant(session.tenant)
            }
        };
        let hits = self
            .store
            .search_messages(scope, query, limit)
            .await
            .map_err(failed)?;
        Ok(hits
            .into_iter()
            .map(|hit| MemoryHit {
                session_id: hit.session_id,
                run_id: hit.run_id,
                message_id: hit.message_id,
                role: hit.role,
                created_at: hit.created_at,
                snippet: hit.snippet,
            })
            .collect())
    }
}

/// What the model is told when a search fails. A tool's outcome is data the model sees, so a
/// store failure is logged here and the model gets no internals.
fn failed(error: ratchet_store::Error) -> String {
    match error {
        ratchet_store::Error::Invalid(reason) => reason,
        other => {
            tracing::warn!(error = %other, "memory search failed");
            "the memory search failed; try again later".to_owned()
        }
    }
}
