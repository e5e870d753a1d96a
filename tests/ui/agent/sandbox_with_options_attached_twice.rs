use flue_runtime::prelude::*;
use flue_runtime::sandbox::virtual_sandbox;

#[agent]
fn assistant() -> &'static str {
    use_model("openai/gpt-4o");
    use_sandbox_with(virtual_sandbox(), SandboxOptions::default());
    use_sandbox_with(virtual_sandbox(), SandboxOptions::default());
    "Help."
}

fn main() {}
