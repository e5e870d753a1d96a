use std::fmt::Debug;

use flue_runtime::prelude::*;

#[hook(after_system_message)]
fn log_prompt(_state: &ThreadState, message: &dyn Debug) -> Option<String> {
    let _ = format!("{message:?}");
    None
}

fn main() {}
