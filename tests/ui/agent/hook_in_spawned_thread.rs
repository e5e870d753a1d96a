use std::thread;

use flue_runtime::prelude::*;

/// Add two numbers.
#[tool]
async fn add(a: i64, b: i64) -> String {
    (a + b).to_string()
}

#[agent]
fn threaded() -> &'static str {
    use_model("openai/gpt-4o");
    thread::scope(|scope| {
        scope.spawn(|| use_tool(add));
        let _ = thread::Builder::new().spawn_scoped(scope, || use_instruction("Scoped."));
    });
    let _ = std::thread::spawn(|| use_persistent_state("count", 0u32).0).join();
    let _ = thread::spawn(|| use_persistent_state("total", 0u32).0).join();
    "Threaded."
}

fn main() {}
