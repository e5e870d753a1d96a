use flue_runtime::prelude::*;

#[derive(serde::Deserialize)]
enum Priority {
    Low,
    High,
}

/// Set an issue's priority.
#[tool]
async fn set_priority(number: u64, priority: Priority) -> String {
    let _ = (number, matches!(priority, Priority::Low | Priority::High));
    String::new()
}

fn main() {}
