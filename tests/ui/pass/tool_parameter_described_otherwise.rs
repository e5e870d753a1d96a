//! A tool parameter whose attributes parse and describe it by other means needs neither derive
//! on its type.
use flue_runtime::prelude::*;

/// A type of another crate, say, without schemars' feature for it.
#[derive(serde::Deserialize)]
struct Stamp(String);

/// Note when something happened.
#[tool]
async fn note_time(
    /// When, as an RFC 3339 timestamp.
    #[schemars(with = "String")]
    at: Stamp,
) -> String {
    at.0
}

fn main() {
    let _ = note_time;
}
