use flue_runtime::prelude::*;

#[agent]
fn assistant(_props: AgentProps, _verbose: bool) -> &'static str {
    "Help."
}

fn main() {}
