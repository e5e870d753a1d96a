use flue_runtime::prelude::*;
use std::rc::Rc;

async fn fetch() -> u64 {
    7
}

/// Count twice.
#[tool]
async fn count_twice() -> String {
    let shared = Rc::new(1u64);
    let fetched = fetch().await;
    (*shared + fetched).to_string()
}

fn main() {}
