use flue_runtime::prelude::*;

#[agent]
fn assistant(props: AgentProps, verbose: bool) -> &'static str {
    "Help."
}

fn main() {}
