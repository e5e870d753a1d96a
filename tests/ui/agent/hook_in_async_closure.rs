use flue_runtime::prelude::*;

#[agent]
fn assistant() -> &'static str {
    use_model("openai/gpt-4o");
    let _later = async || {
        let _delivery = use_delivery();
    };
    "Help."
}

fn main() {}
