use flue_runtime::prelude::*;

#[hook(after_create_message)]
fn audit(_state: &ThreadState, _message: &Message) {
    let _tier: Option<String> = flue_runtime::prelude::use_initial_data();
}

fn main() {}
