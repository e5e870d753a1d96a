//! Hook calls in the arguments of a macro an agent body calls run in its render, and are not
//! refused. A macro that is not one of the standard library's expression macros is not
//! searched (its tokens need not be calls at all), nor is one under `cfg`.
use flue_runtime::prelude::*;

macro_rules! quoted {
    ($($tokens:tt)*) => {
        stringify!($($tokens)*)
    };
}

/// Look a word up.
#[tool]
async fn lookup(word: String) -> String {
    // A macro of the user's own: its tokens are only quoted here, nothing is called.
    let _ = quoted!(use_model("openai/gpt-4o"));
    #[cfg(any())]
    println!("{}", use_persistent_state("never", 0u32).0);
    word
}

#[agent]
fn counter() -> String {
    use_model("openai/gpt-4o");
    use_tool(lookup);
    let counts = vec![use_persistent_state("count", 0u32).0; 2];
    assert!(!counts.is_empty(), "{}", use_persistent_state("seen", 0u32).0);
    format!("Count from {}.", use_persistent_state("start", 1u32).0)
}

fn main() {}
