use flue_runtime::prelude::*;

#[hook]
async fn audit(_state: &ThreadState) {}

// The item is still there: an agent listing it reports nothing more.
#[agent(hooks = [audit])]
fn audited() -> &'static str {
    "A"
}

fn main() {}
