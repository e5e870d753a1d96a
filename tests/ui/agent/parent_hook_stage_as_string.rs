use flue_runtime::prelude::*;

#[hook(after_system_message)]
fn mail_context(_state: &ThreadState, message: String) -> String {
    message
}

#[agent(expose_as_tool, parent_hooks = [(mail_context, "before_parent", "Shows new mail.")])]
fn mail_agent() -> &'static str {
    "Read mail."
}

fn main() {}
