use flue_runtime::prelude::*;
use flue_runtime::sandbox::virtual_sandbox;

#[agent]
fn assistant() -> &'static str {
    use_model("openai/gpt-4o");
    use_sandbox(virtual_sandbox());
    flue_runtime::prelude::use_sandbox(virtual_sandbox());
    "Help."
}

fn main() {}
