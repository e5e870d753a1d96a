//! An agent returns anything `Into<Instruction>`, `impl Into<Instruction>` included.
use flue_runtime::prelude::*;

#[agent]
fn greeter() -> impl Into<Instruction> {
    "You greet people."
}

fn main() {
    let rendered = flue_runtime::render_bare(&greeter).unwrap();
    assert_eq!(rendered.instruction.as_deref(), Some("You greet people."));
}
