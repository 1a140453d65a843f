//! Runs the store conformance suite against PostgreSQL, each test on its own fresh database
//! (skipped, and saying so, when `RATCHET_TEST_POSTGRES_URL` is not set outside CI).

use std::sync::Arc;

use ratchet_postgres::PgStore;
use ratchet_postgres::testkit::TestDatabase;
use ratchet_store::{Key, Keyring, Store};

async fn fresh_store() -> Option<(Arc<PgStore>, TestDatabase)> {
    let database = TestDatabase::create()?;
    let store = ratchet_postgres::open_url(database.url())
        .unwrap_or_else(|e| panic!("open {}: {e}", database.url()))
        .with_secrets(Keyring::new(Key::generate().unwrap(), Vec::new()).unwrap());
    Some((Arc::new(store), database))
}

ratchet_store_conformance::store_conformance_tests!(fresh_store());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_are_sealed_with_the_stores_key_and_sealed_again_under_a_new_one() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    ratchet_store_conformance::secrets_are_sealed_with_the_stores_key_and_sealed_again_under_a_new_one(
        |keyring| {
            let store = ratchet_postgres::open_url(database.url())
                .unwrap()
                .with_secrets(keyring);
            Arc::new(store) as Arc<dyn Store>
        },
    )
    .await;
}
