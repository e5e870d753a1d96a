use flue_runtime::prelude::*;

#[agent]
fn assistant(verbose: bool) -> &'static str {
    if verbose { "Help at length." } else { "Help." }
}

fn main() {}
