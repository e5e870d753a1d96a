use flue_runtime::prelude::*;

#[hook(after_thread_created, id = "AuditThread")]
async fn audit(_state: &ThreadState) {}

fn main() {}
