use flue_runtime::prelude::*;

#[hook(before_create_message)]
fn tag(_state: &ThreadState, _message: Message) -> Result<String, String> {
    Err("no room".to_owned())
}

fn main() {}
