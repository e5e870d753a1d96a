use flue_runtime::prelude::*;

#[hook(after_system_message)]
fn mail_context(_state: &ThreadState, message: String) -> String {
    message
}

#[hook(after_system_message)]
fn signature(_state: &ThreadState, message: String) -> String {
    message
}

#[agent]
fn mail_agent() -> &'static str {
    use_model("openai/gpt-4o");
    use_hooks([mail_context]);
    use_hooks([signature, mail_context]);
    "Read mail."
}

fn main() {}
