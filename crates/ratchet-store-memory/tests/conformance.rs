//! Runs the store conformance suite against the in-memory store, each test on a fresh one.

use std::sync::Arc;

use ratchet_store::{Key, Keyring, Store};
use ratchet_store_memory::MemoryStore;

/// A fresh, empty store; nothing outlives it.
async fn fresh_store() -> Option<(Arc<MemoryStore>, ())> {
    let keyring = Keyring::new(Key::generate().unwrap(), Vec::new()).unwrap();
    Some((Arc::new(MemoryStore::new().with_secrets(keyring)), ()))
}

ratchet_store_conformance::store_conformance_tests!(fresh_store());

/// Each `open` is another handle on one store's data, with the keys it is given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_are_sealed_with_the_stores_key_and_sealed_again_under_a_new_one() {
    let data = MemoryStore::new();
    ratchet_store_conformance::secrets_are_sealed_with_the_stores_key_and_sealed_again_under_a_new_one(
        |keyring| Arc::new(data.clone().with_secrets(keyring)) as Arc<dyn Store>,
    )
    .await;
}
