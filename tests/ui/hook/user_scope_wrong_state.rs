use flue_runtime::prelude::*;

#[hook(user_value_changed)]
async fn announce(_state: &ThreadState, _key: &str) {}

fn main() {}
