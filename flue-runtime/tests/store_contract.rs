//! The store contract, run against the memory store (SQLite and Postgres run it in their own
//! files).
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

mod contract;

use std::sync::Arc;

use flue_runtime::store::{MemoryStore, Store};

contract::store_contract!(memory, || async {
    Some(Arc::new(MemoryStore::new()) as Arc<dyn Store>)
});
