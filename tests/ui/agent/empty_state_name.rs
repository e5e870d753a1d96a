use flue_runtime::prelude::*;

#[agent]
fn counter() -> String {
    use_model("openai/gpt-4o");
    let (count, _set_count) = use_persistent_state("", 0u32);
    format!("Counted {count}.")
}

fn main() {}
