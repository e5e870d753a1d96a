use flue_runtime::prelude::*;

/// Count the notes.
#[tool]
async fn count_notes() -> String {
    format!("{} notes", use_persistent_state("notes", 0u32).0)
}

fn main() {}
