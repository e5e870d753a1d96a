use flue_runtime::prelude::*;

/// Count the notes.
#[tool]
async fn count_notes() -> String {
    format!("{} notes", use_persistent_state("notes", 0u32).0)
}

/// Repeat the notes.
#[tool]
async fn repeat_notes() -> String {
    let notes = std::vec![use_persistent_state("notes", 0u32).0; 2];
    format!("{notes:?}")
}

fn main() {}
