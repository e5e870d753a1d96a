use flue_runtime::prelude::*;

#[agent]
fn reporter() -> &'static str {
    use_model("openai/gpt-4o");
    let _progress = use_data_writer::<u32>("");
    "Report."
}

fn main() {}
