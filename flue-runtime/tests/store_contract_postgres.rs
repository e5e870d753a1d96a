//! The store contract, run against `PostgresStore` (feature `postgres`). Each test gets a fresh
//! schema of the database at `FLUE_TEST_POSTGRES_URL` (`.ci/test` starts a throwaway server and
//! sets it), so the tests run in parallel. Without the variable the tests fail under CI and
//! return early, with a note, elsewhere.
#![cfg(feature = "postgres")]
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

mod contract;
mod harness;

use std::sync::Arc;

use flue_runtime::store::{PostgresStore, Store};

/// A store in a fresh schema, or `None` (outside CI) when no test database is configured.
async fn fresh_store() -> Option<Arc<dyn Store>> {
    let url = harness::postgres_url("the Postgres store tests")?;
    let schema = harness::fresh_schema("flue_test");
    let store = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
    Some(Arc::new(store) as Arc<dyn Store>)
}

contract::store_contract!(postgres, fresh_store);
