//! A block doc comment with a star down its left side is a description without the stars
//! (as rustdoc reads it), for a tool and for an agent.
use flue_runtime::prelude::*;

/**
 * Look something up.
 *
 * Then say what was found:
 *   - where
 */
#[tool]
async fn lookup(query: String) -> String {
    query
}

/**
 * Answers questions.
 */
#[agent]
fn assistant() -> &'static str {
    "You help."
}

fn main() {
    assert_eq!(
        lookup.into_tool().definition().description,
        "Look something up.\n\nThen say what was found:\n  - where"
    );
    assert_eq!(assistant.definition().description.as_deref(), Some("Answers questions."));
}
