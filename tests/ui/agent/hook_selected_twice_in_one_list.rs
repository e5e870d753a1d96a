use flue_runtime::prelude::*;

#[hook(after_system_message)]
fn mail_context(_state: &ThreadState, message: String) -> String {
    message
}

#[agent]
fn mail_agent() -> &'static str {
    use_model("openai/gpt-4o");
    use_hooks([mail_context, mail_context]);
    "Read mail."
}

fn main() {}
