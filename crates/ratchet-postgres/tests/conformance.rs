//! Runs the store conformance suite against PostgreSQL, each test on its own fresh database
//! (skipped, and saying so, when `RATCHET_TEST_POSTGRES_URL` is not set outside CI).

use std::sync::Arc;

use ratchet_postgres::PgStore;
use ratchet_postgres::testkit::TestDatabase;

async fn fresh_store() -> Option<(Arc<PgStore>, TestDatabase)> {
    let database = TestDatabase::create()?;
    let store = ratchet_postgres::open_url(database.url())
        .unwrap_or_else(|e| panic!("open {}: {e}", database.url()));
    Some((Arc::new(store), database))
}

ratchet_store::store_conformance_tests!(fresh_store());
