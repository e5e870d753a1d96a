use flue_runtime::prelude::*;

#[derive(schemars::JsonSchema)]
struct Progress {
    done: u32,
}

#[agent]
fn assistant() -> &'static str {
    use_model("openai/gpt-4o");
    let _progress = use_data_writer::<Progress>("progress");
    "Help."
}

fn main() {}
