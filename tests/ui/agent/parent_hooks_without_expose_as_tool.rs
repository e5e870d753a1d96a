use flue_runtime::prelude::*;

#[agent(parent_hooks = [(mail_context, before_parent, "Shows new mail to the coordinator.")])]
fn mail_agent() -> &'static str {
    "Read mail."
}

fn main() {}
