use flue_runtime::prelude::*;

#[derive(schemars::JsonSchema)]
struct Window {
    days: u32,
}

/// Count the issues opened in a window.
#[tool]
async fn count_opened(
    /// How far back to look.
    window: Window,
) -> String {
    window.days.to_string()
}

fn main() {}
