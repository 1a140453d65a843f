//! Runs the store conformance suite against SQLite, each test on its own fresh database
//! file.

use std::sync::Arc;

use ratchet_sqlite::SqliteStore;
use tempfile::TempDir;

/// A fresh, empty store; the TempDir is returned so the file outlives the test. SQLite is
/// always available, so there is always one.
async fn fresh_store() -> Option<(Arc<SqliteStore>, TempDir)> {
    let dir = tempfile::tempdir().expect("create a temp dir");
    let path = dir.path().join("ratchet.db");
    let store = ratchet_sqlite::open_url(&format!("sqlite://{}", path.display()))
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    Some((Arc::new(store), dir))
}

ratchet_store::store_conformance_tests!(fresh_store());
