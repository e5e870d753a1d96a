//! Hook calls in plain closures the render runs (an iterator's, a `thread::scope`'s own), and
//! in an agent function a tool renders itself (on a thread it spawned, too), are not refused:
//! they may run inside a render.
use flue_runtime::prelude::*;

/// Add two numbers.
#[tool]
async fn add(a: i64, b: i64) -> String {
    (a + b).to_string()
}

/// Subtract two numbers.
#[tool]
async fn subtract(a: i64, b: i64) -> String {
    (a - b).to_string()
}

/// Says which model a nested agent would use.
#[tool]
async fn nested_model() -> String {
    let nested = FnAgent::new(AgentDefinition::new("nested"), |_props| {
        use_model("openai/gpt-4o");
        "Nested."
    });
    let rendered = flue_runtime::render_bare(&nested).unwrap();
    rendered.model.map(|model| model.spec.to_string()).unwrap_or_default()
}

/// Says which model a nested agent would use, rendered on a thread of its own.
#[tool]
async fn threaded_model() -> String {
    std::thread::spawn(|| {
        let nested = FnAgent::new(AgentDefinition::new("nested"), |_props| {
            use_model("openai/gpt-4o");
            "Nested."
        });
        let rendered = flue_runtime::render_bare(&nested).unwrap();
        rendered.model.map(|model| model.spec.to_string()).unwrap_or_default()
    })
    .join()
    .unwrap_or_default()
}

#[agent]
fn calculator() -> &'static str {
    use_model("openai/gpt-4o");
    (0..1).for_each(|_| use_tool(add));
    let mount = || use_tool(subtract);
    mount();
    use_tool(nested_model);
    // A scope's own closure runs in the render, on its thread.
    std::thread::scope(|_scope| use_tool(threaded_model));
    use_agent_start(|_ctx| async {});
    "Calculate."
}

fn main() {}
