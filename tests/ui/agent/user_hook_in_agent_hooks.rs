use flue_runtime::prelude::*;

#[hook(user_value_changed)]
fn announce(_user: &UserState, _key: &str) {}

#[agent(hooks = [announce])]
fn assistant() -> &'static str {
    "Help."
}

fn main() {}
