//! One render of a representative agent: a model, 8 tools, 2 state values, 1 data writer and
//! 4 event hooks, rendered the way the runtime renders it (state view, binding, delivery,
//! previous data-writer names, capacity hint).
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use flue_core::data::{SchemaSource, tool_input_schema_of};
use flue_core::prelude::*;
use flue_core::state::StateSnapshot;
use flue_core::testing::TestBinding;
use flue_core::tool::{ToolDefinition, ToolHandler};
use serde_json::{Value, json};

#[derive(serde::Deserialize, schemars::JsonSchema)]
struct Args {
    #[allow(dead_code)]
    query: String,
}

/// Eight zero-sized tools, shaped like what `#[tool]` generates.
macro_rules! static_tools {
    ($($name:ident),*) => {$(
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy)]
        struct $name;
        impl ToolHandler for $name {
            fn definition(&self) -> &ToolDefinition {
                static DEFINITION: ToolDefinition = ToolDefinition::from_checked(
                    stringify!($name),
                    "A benchmark tool.",
                    SchemaSource::Typed(tool_input_schema_of::<Args>),
                    None,
                    &[],
                    false,
                );
                &DEFINITION
            }
            fn call(&self, _ctx: ToolContext, _args: Value) -> flue_core::BoxFuture<'_, ToolOutput> {
                Box::pin(async { ToolOutput::text("ok") })
            }
        }
    )*};
}
static_tools!(
    search,
    fetch,
    summarize,
    classify,
    lookup_user,
    lookup_order,
    refund,
    escalate
);

fn agent() -> impl Agent {
    FnAgent::new(AgentDefinition::new("bench_agent"), |_props| {
        use_model_with(
            "anthropic/claude-sonnet-4-5",
            ModelOptions::thinking(ThinkingLevel::Low),
        );
        use_tool(search);
        use_tool(fetch);
        use_tool(summarize);
        use_tool(classify);
        use_tool(lookup_user);
        use_tool(lookup_order);
        use_tool(refund);
        use_tool(escalate);
        let (phase, _set_phase) = use_persistent_state("phase", 0u32);
        let (_notes, _set_notes) = use_persistent_state("seen", 0u64);
        let _progress = use_data_writer::<u32>("progress");
        use_agent_start(|_ctx| async {});
        use_agent_finish(|_ctx| async {});
        use_response_start(|_ctx| ());
        use_response_finish(|_ctx| ());
        if phase == 0 {
            "You are a support agent. Gather the facts first."
        } else {
            "You are a support agent."
        }
    })
}

fn render(c: &mut Criterion) {
    let agent = agent();
    let binding = TestBinding::with_snapshot(StateSnapshot::from_iter([("phase".to_owned(), json!(0))]));
    let runtime = binding.as_binding();
    let delivery = Arc::new(DeliveredMessage::user("Where is my order?"));
    let warm = flue_core::render_bare(&agent).expect("renders");
    let previous = warm.data_writer_names();
    let hint = warm.declaration_count();
    c.bench_function("render/model+8tools+2state+1writer+4hooks", |b| {
        b.iter(|| {
            let state = RenderState::root("inst-1")
                .with_state(&*binding)
                .with_binding(&runtime)
                .with_delivery(&delivery)
                .with_previous_data_writers(&previous)
                .with_capacity_hint(hint);
            std::hint::black_box(flue_core::render(&agent, &state).expect("renders"))
        })
    });
    let mut spare = flue_core::render_bare(&agent).expect("renders");
    c.bench_function("render/model+8tools+2state+1writer+4hooks/into", |b| {
        b.iter(|| {
            // As the runtime does at a turn boundary: hold the attempt's buffer for the render.
            let buffer = binding.state();
            let state = RenderState::root("inst-1")
                .with_state(&*buffer)
                .with_binding(&runtime)
                .with_delivery(&delivery)
                .with_previous_data_writers(&previous);
            flue_core::render_into(&agent, &state, &mut spare).expect("renders");
            std::hint::black_box(&spare);
        })
    });
    c.bench_function("render/bare", |b| {
        b.iter(|| std::hint::black_box(flue_core::render_bare(&agent).expect("renders")))
    });
}

criterion_group!(benches, render);
criterion_main!(benches);
