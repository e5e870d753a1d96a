use flue_runtime::prelude::*;

#[hook(after_thread_created)]
fn audit(audit: &ThreadState) {
    let _ = audit;
}

fn main() {}
