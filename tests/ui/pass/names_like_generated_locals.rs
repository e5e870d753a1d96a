//! An item may have any name, including the names of its expansion's locals (`args`, `ctx`,
//! `output`, `definition`, `props`, `hook`), and a body sees the user's items named like the
//! expansion's (`DEFINITION`), in its body and in its options.
use flue_runtime::prelude::*;

const DEFINITION: &str = "the user's";

/// Print the text.
#[tool]
async fn output(text: String) -> String {
    text
}

/// Echo the arguments.
#[tool]
async fn args(text: String) -> String {
    text
}

/// Describe the context.
#[tool]
async fn ctx(text: String) -> String {
    text
}

#[hook(after_thread_created)]
fn hook(_state: &ThreadState) {}

#[hook(after_thread_created)]
fn greet(_state: &ThreadState) {
    let user: &str = DEFINITION;
    assert_eq!(user, "the user's");
}

#[agent(hooks = [hook])]
fn definition() -> &'static str {
    use_tool(output);
    use_tool(args);
    use_tool(ctx);
    "You define words."
}

#[agent]
fn props() -> &'static str {
    "You show props."
}

/// The options' expressions see the user's items too: a hook list naming a `DEFINITION`.
mod listed {
    use flue_runtime::prelude::*;

    #[hook(after_thread_created)]
    fn welcome(_state: &ThreadState) {}

    const DEFINITION: ThreadHook = welcome;

    #[agent(hooks = [DEFINITION])]
    pub fn listed() -> &'static str {
        "You list hooks."
    }
}

fn main() {
    assert_eq!(listed::listed.definition().name, "listed");
    assert_eq!(definition.definition().name, "definition");
    assert_eq!(props.definition().name, "props");
    assert_eq!(output.into_tool().name(), "output");
    assert_eq!(hook.id(), "hook");
    assert_eq!(greet.id(), "greet");
}
