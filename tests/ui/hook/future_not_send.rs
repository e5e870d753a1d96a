use flue_runtime::prelude::*;
use std::cell::RefCell;

async fn audit() {}

#[hook(after_thread_created)]
async fn remember(_state: &ThreadState) {
    let seen = RefCell::new(0u32);
    let mut count = seen.borrow_mut();
    audit().await;
    *count += 1;
}

fn main() {}
