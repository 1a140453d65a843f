//! Runs the store conformance suite against SQLite, each test on its own fresh database
//! file.

use std::sync::Arc;

use ratchet_sqlite::SqliteStore;
use ratchet_store::{Key, Keyring, Store};
use tempfile::TempDir;

/// A fresh, empty store; the TempDir is returned so the file outlives the test. SQLite is
/// always available, so there is always one.
async fn fresh_store() -> Option<(Arc<SqliteStore>, TempDir)> {
    let dir = tempfile::tempdir().expect("create a temp dir");
    let path = dir.path().join("ratchet.db");
    let store = ratchet_sqlite::open_url(&format!("sqlite://{}", path.display()))
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
        .with_secrets(Keyring::new(Key::generate().unwrap(), Vec::new()).unwrap());
    Some((Arc::new(store), dir))
}

ratchet_store_conformance::store_conformance_tests!(fresh_store());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_are_sealed_with_the_stores_key_and_sealed_again_under_a_new_one() {
    let dir = tempfile::tempdir().expect("create a temp dir");
    let url = format!("sqlite://{}", dir.path().join("ratchet.db").display());
    ratchet_store_conformance::secrets_are_sealed_with_the_stores_key_and_sealed_again_under_a_new_one(
        |keyring| {
            let store = ratchet_sqlite::open_url(&url).unwrap().with_secrets(keyring);
            Arc::new(store) as Arc<dyn Store>
        },
    )
    .await;
}
