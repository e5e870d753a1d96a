use flue_runtime::prelude::*;

#[agent]
fn counter() -> String {
    use_model("openai/gpt-4o");
    let (count, _set_count) = use_persistent_state("count", 0u32);
    let (total, _set_total) = use_persistent_state_opt::<u64>("count");
    format!("Counted {count} of {total:?}.")
}

fn main() {}
