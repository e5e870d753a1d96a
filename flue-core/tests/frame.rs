//! The render frame: outside-render detection, re-entrancy, cleanup on panic, bare renders.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

mod common;

use std::sync::Arc;

use common::{NoSandbox, agent, echo_tool, panic_message_of, render_panic};
use flue_core::prelude::*;
use flue_core::{RenderError, is_rendering};

fn outside(hook: &str) -> String {
    format!(
        "[flue] {hook}() was called outside an agent function. Flue Hooks compose an agent while it renders: call them synchronously in the agent function body (or in a custom hook it calls), not from tools, actions, event handlers, or module scope."
    )
}

#[test]
fn every_hook_panics_outside_an_agent_function_with_the_reference_message() {
    type Case = (&'static str, Box<dyn Fn()>);
    let cases: Vec<Case> = vec![
        ("use_model", Box::new(|| use_model("openai/gpt-4o"))),
        (
            "use_model",
            Box::new(|| use_model_with("openai/gpt-4o", ModelOptions::default())),
        ),
        ("use_sandbox", Box::new(|| use_sandbox(NoSandbox))),
        (
            "use_sandbox",
            Box::new(|| use_sandbox_with(NoSandbox, flue_core::sandbox::SandboxOptions::default())),
        ),
        ("use_tool", Box::new(|| use_tool(echo_tool("echo")))),
        (
            "use_skill",
            Box::new(|| use_skill(Skill::new("triage", "Triage issues.", "Steps.").unwrap())),
        ),
        ("use_subagent", Box::new(|| use_subagent(Subagent::general()))),
        ("use_instruction", Box::new(|| use_instruction("text"))),
        ("use_persistent_state", Box::new(|| drop(use_persistent_state("n", 0)))),
        (
            "use_persistent_state",
            Box::new(|| drop(use_persistent_state_opt::<u8>("n"))),
        ),
        ("use_initial_data", Box::new(|| _ = use_initial_data::<u8>())),
        ("use_delivery", Box::new(|| drop(use_delivery()))),
        ("use_dispatch_message", Box::new(|| drop(use_dispatch_message()))),
        ("use_data_writer", Box::new(|| drop(use_data_writer::<u8>("d")))),
        (
            "use_data_writer",
            Box::new(|| {
                let schema = flue_core::data::DataSchema::new(serde_json::json!({"type": "object"})).unwrap();
                drop(use_data_writer_with_schema("d", &schema));
            }),
        ),
        ("use_agent_start", Box::new(|| use_agent_start(|_| async {}))),
        ("use_agent_finish", Box::new(|| use_agent_finish(|_| async {}))),
        ("use_response_start", Box::new(|| use_response_start(|_| ()))),
        ("use_response_finish", Box::new(|| use_response_finish(|_| ()))),
        (
            "use_mcp_connection",
            Box::new(|| use_mcp_connection(McpConnection::new("s", "https://mcp.example.com"))),
        ),
        ("use_hooks", Box::new(|| use_hooks([]))),
    ];
    for (hook, call) in cases {
        assert_eq!(panic_message_of(call), outside(hook), "{hook}");
    }
}

#[test]
fn a_custom_hook_called_outside_a_render_panics_at_its_first_inner_hook() {
    fn use_support_basics() {
        use_instruction("Be kind.");
        use_model("openai/gpt-4o");
    }
    assert_eq!(panic_message_of(use_support_basics), outside("use_instruction"));
}

#[test]
fn a_hook_called_from_a_tool_closure_after_the_render_panics_outside() {
    let captured = std::sync::Mutex::new(None::<Box<dyn Fn() + Send>>);
    let agent = agent(move |_| {
        use_model("openai/gpt-4o");
        "x"
    });
    flue_core::render_bare(&agent).unwrap();
    *captured.lock().unwrap() = Some(Box::new(|| use_instruction("late")));
    let message = panic_message_of(|| (captured.lock().unwrap().as_ref().unwrap())());
    assert_eq!(message, outside("use_instruction"));
}

#[test]
fn a_render_inside_a_render_is_rejected_as_re_entrant() {
    let inner = Arc::new(agent(|_| {
        use_model("openai/gpt-4o");
        "inner"
    }));
    let outer = {
        let inner = inner.clone();
        agent(move |_| {
            use_model("openai/gpt-4o");
            let _ = flue_core::render_bare(inner.as_ref());
            "outer"
        })
    };
    assert_eq!(
        render_panic(&outer),
        "[flue] Re-entrant agent render. An agent function must not invoke another agent function directly; compose shared behavior with custom hooks instead."
    );
}

/// Calling another agent's body directly inside a render (its hooks would join this render
/// unnoticed, or claim a second model) is the same re-entrant render, reported where it is
/// called; the render after it works.
#[test]
fn an_agent_body_calling_another_agents_body_is_rejected_as_re_entrant() {
    let shared = Arc::new(agent(|_| {
        use_instruction("Be brief.");
        "shared"
    }));
    let outer = {
        let shared = shared.clone();
        agent(move |props| {
            use_model("openai/gpt-4o");
            let _ = shared.render_body(props);
            "outer"
        })
    };
    match flue_core::try_render(&outer, &RenderState::bare()) {
        Err(RenderError::Panicked { message, location }) => {
            assert_eq!(
                message,
                "[flue] Re-entrant agent render. An agent function must not invoke another agent function directly; compose shared behavior with custom hooks instead."
            );
            assert!(location.is_some_and(|location| location.contains("frame.rs")));
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(flue_core::render_bare(shared.as_ref()).is_ok(), "the next render works");
}

#[test]
fn a_panicking_agent_body_leaves_no_frame_behind_and_the_next_render_works() {
    let broken = agent(|_| -> &'static str {
        use_model("openai/gpt-4o");
        panic!("boom in the agent body");
    });
    match flue_core::try_render(&broken, &RenderState::bare()) {
        Err(RenderError::Panicked { message, location }) => {
            assert_eq!(message, "boom in the agent body");
            assert_eq!(location, None, "a plain panic is not a rules-of-hooks violation");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(!is_rendering());
    assert_eq!(panic_message_of(|| use_model("openai/gpt-4o")), outside("use_model"));
    let healthy = agent(|_| {
        use_model("openai/gpt-4o");
        "fine"
    });
    assert_eq!(
        flue_core::render_bare(&healthy).unwrap().instruction.as_deref(),
        Some("fine")
    );
}

#[test]
fn an_agent_body_that_returns_an_error_fails_its_render_with_the_text_and_the_next_render_works() {
    let parsed = agent(|_| -> Result<String, std::num::ParseIntError> {
        use_model("openai/gpt-4o");
        let limit: u32 = "ten".parse()?;
        Ok(format!("Answer in {limit} words."))
    });
    let failed = RenderError::Failed {
        message: "invalid digit found in string".to_owned(),
    };
    assert_eq!(
        flue_core::try_render(&parsed, &RenderState::bare()).unwrap_err(),
        failed
    );
    assert_eq!(
        flue_core::render_bare(&parsed).unwrap_err(),
        failed,
        "the untried render fails the same way: an error is no panic"
    );
    assert!(!is_rendering());
    // An error that shows its cause in its alternate form only, as `anyhow::Error` does.
    struct Contextual;
    impl std::fmt::Display for Contextual {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("reading the limit")?;
            if f.alternate() {
                f.write_str(": no such file")?;
            }
            Ok(())
        }
    }
    let contextual = agent(|_| -> Result<&'static str, Contextual> {
        use_model("openai/gpt-4o");
        Err(Contextual)
    });
    assert_eq!(
        flue_core::render_bare(&contextual).unwrap_err(),
        RenderError::Failed {
            message: "reading the limit: no such file".to_owned()
        }
    );
    let answered = agent(|_| -> Result<Option<String>, String> {
        use_model("openai/gpt-4o");
        Ok(Some("Answer briefly.".to_owned()))
    });
    assert_eq!(
        flue_core::render_bare(&answered).unwrap().instruction.as_deref(),
        Some("Answer briefly.")
    );
}

#[test]
fn is_rendering_is_true_only_during_a_render() {
    assert!(!is_rendering());
    let agent = agent(|_| {
        assert!(is_rendering());
        use_model("openai/gpt-4o");
    });
    flue_core::render_bare(&agent).unwrap();
    assert!(!is_rendering());
}

#[test]
fn a_rules_violation_names_the_users_line() {
    let agent = agent(|_| {
        use_model("openai/gpt-4o");
        use_model("openai/gpt-4o"); // the offending line
    });
    let Err(RenderError::Panicked {
        location: Some(location),
        ..
    }) = flue_core::try_render(&agent, &RenderState::bare())
    else {
        panic!("expected a located violation");
    };
    let expected_line = line!() - 9;
    assert_eq!(location, format!("{}:{expected_line}:9", file!()));
}

#[test]
fn renders_on_separate_threads_do_not_see_each_other() {
    let handles: Vec<_> = (0..4)
        .map(|i| {
            std::thread::spawn(move || {
                let agent = agent(move |_| {
                    use_model("openai/gpt-4o");
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    format!("thread {i}")
                });
                flue_core::render_bare(&agent)
                    .unwrap()
                    .instruction
                    .unwrap()
                    .into_owned()
            })
        })
        .collect();
    for (i, handle) in handles.into_iter().enumerate() {
        assert_eq!(handle.join().unwrap(), format!("thread {i}"));
    }
}

#[test]
fn props_id_is_the_instance_id_and_panics_on_a_bare_render() {
    let agent = agent(|props| {
        use_model("openai/gpt-4o");
        format!("id={}", props.id())
    });
    let rendered = flue_core::render(&agent, &RenderState::root("inst-7")).unwrap();
    assert_eq!(rendered.instruction.as_deref(), Some("id=inst-7"));
    assert_eq!(
        render_panic(&agent),
        "[flue] This render has no agent instance behind it, so `props.id()` is unavailable. Pass an instance id in the render state to back it in tests and tooling."
    );
}

#[test]
fn a_bare_render_reads_defaults() {
    let agent = agent(|_| {
        use_model("openai/gpt-4o");
        let (count, _) = use_persistent_state("count", 41u32);
        let data: Option<serde_json::Value> = use_initial_data();
        format!("{count} {data:?}")
    });
    let rendered = flue_core::render_bare(&agent).unwrap();
    assert_eq!(rendered.instruction.as_deref(), Some("41 None"));
}

#[test]
fn use_delivery_panics_on_a_bare_render_and_reads_the_cursor_otherwise() {
    let agent = agent(|_| {
        use_model("openai/gpt-4o");
        use_delivery().body().to_owned()
    });
    assert_eq!(
        render_panic(&agent),
        "[flue] use_delivery() found no delivered message behind this render. Every agent run in the runtime is triggered by one; a direct render outside the runtime (tests, tooling) must supply a `delivery` in its render-state context."
    );
    let delivery = Arc::new(DeliveredMessage::user("hello there"));
    let rendered = flue_core::render(&agent, &RenderState::root("i").with_delivery(&delivery)).unwrap();
    assert_eq!(rendered.instruction.as_deref(), Some("hello there"));
}
