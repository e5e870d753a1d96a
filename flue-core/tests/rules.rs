//! The rules of hooks of reference §2.4–§2.6, one test per rule.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

mod common;

use std::borrow::Cow;
use std::sync::Arc;

use common::{NoSandbox, agent, echo_tool, render_panic, subagent_render_panic};
use flue_core::model::ModelOptionsError;
use flue_core::prelude::*;
use flue_core::{RenderError, ToolNameConflict};

// ---- instruction composition -------------------------------------------------------------

#[test]
fn instruction_is_the_returned_text_then_use_instruction_parts_joined_by_blank_lines() {
    let agent = agent(|_| {
        use_model("openai/gpt-4o");
        use_instruction("First part.");
        use_instruction(String::from("Second part."));
        "Returned text."
    });
    let rendered = flue_core::render_bare(&agent).unwrap();
    assert_eq!(
        rendered.instruction.as_deref(),
        Some("Returned text.\n\nFirst part.\n\nSecond part.")
    );
}

#[test]
fn an_empty_returned_instruction_is_skipped_in_composition() {
    let agent = agent(|_| {
        use_model("openai/gpt-4o");
        use_instruction("Only part.");
        ""
    });
    assert_eq!(
        flue_core::render_bare(&agent).unwrap().instruction.as_deref(),
        Some("Only part.")
    );
}

#[test]
fn an_agent_returning_nothing_and_no_parts_has_no_instruction() {
    let agent = agent(|_| use_model("openai/gpt-4o"));
    assert_eq!(flue_core::render_bare(&agent).unwrap().instruction, None);
}

#[test]
fn a_returned_static_str_is_not_copied() {
    let agent = agent(|_| {
        use_model("openai/gpt-4o");
        "static"
    });
    assert!(matches!(
        flue_core::render_bare(&agent).unwrap().instruction,
        Some(Cow::Borrowed("static"))
    ));
}

#[test]
fn use_instruction_rejects_blank_text() {
    let agent = agent(|_| {
        use_model("openai/gpt-4o");
        use_instruction("   ");
    });
    assert_eq!(
        render_panic(&agent),
        "[flue] use_instruction() requires a non-empty string."
    );
}

// ---- use_model ----------------------------------------------------------------------------

#[test]
fn use_model_called_twice_in_one_render_panics() {
    let agent = agent(|_| {
        use_model("openai/gpt-4o");
        use_model("anthropic/claude-sonnet-4-5");
    });
    assert_eq!(
        render_panic(&agent),
        "[flue] use_model() was called twice in one render. An agent has one model; call use_model() exactly once (compute the specifier before the call if it depends on state)."
    );
}

#[test]
fn use_model_twice_through_custom_hooks_counts_too() {
    fn use_defaults() {
        use_model("openai/gpt-4o");
    }
    let agent = agent(|_| {
        use_defaults();
        use_model("openai/gpt-4o");
    });
    assert!(render_panic(&agent).starts_with("[flue] use_model() was called twice in one render."));
}

#[test]
fn use_model_rejects_a_blank_specifier() {
    let agent = agent(|_| use_model(" "));
    assert_eq!(
        render_panic(&agent),
        "[flue] use_model() requires a model specifier string, like 'anthropic/claude-sonnet-4-6'."
    );
}

#[test]
fn a_render_without_use_model_cannot_start() {
    let agent = agent(|_| "no model");
    let rendered = flue_core::render_bare(&agent).unwrap();
    assert_eq!(rendered.require_model().unwrap_err(), RenderError::MissingModel);
    assert_eq!(
        RenderError::MissingModel.to_string(),
        "[flue] The agent requires a model. Call use_model(\"provider-id/model-id\") in the agent function."
    );
}

#[test]
fn use_model_records_the_specifier_thinking_level_and_compaction() {
    let agent = agent(|_| {
        use_model_with(
            "anthropic/claude-sonnet-4-5",
            ModelOptions::thinking(ThinkingLevel::Xhigh).with_compaction(Compaction::Threshold(CompactionConfig {
                reserve_tokens: Some(16_000),
                keep_recent_tokens: None,
                model: Some("openai/gpt-4o-mini".into()),
            })),
        );
    });
    let model = flue_core::render_bare(&agent).unwrap().model.unwrap();
    assert_eq!(model.spec, "anthropic/claude-sonnet-4-5");
    assert_eq!(model.options.thinking_level, Some(ThinkingLevel::Xhigh));
    assert!(matches!(model.options.compaction, Compaction::Threshold(ref c) if c.reserve_tokens == Some(16_000)));
}

#[test]
fn use_model_rejects_a_blank_compaction_model() {
    let agent = agent(|_| {
        use_model_with(
            "openai/gpt-4o",
            ModelOptions::default().with_compaction(Compaction::Threshold(CompactionConfig {
                model: Some(" ".into()),
                ..CompactionConfig::default()
            })),
        );
    });
    assert_eq!(
        render_panic(&agent),
        "[flue] use_model() options compaction.model must name a model, like 'anthropic/claude-haiku-4-5'; it is blank."
    );
}

#[test]
fn thinking_levels_parse_including_max_and_reject_unknown_values() {
    let names: Vec<&str> = ThinkingLevel::ALL.iter().map(|level| level.as_str()).collect();
    assert_eq!(names, ["off", "minimal", "low", "medium", "high", "xhigh", "max"]);
    for level in ThinkingLevel::ALL {
        assert_eq!(level.as_str().parse::<ThinkingLevel>().unwrap(), level);
    }
    assert_eq!(
        "extreme".parse::<ThinkingLevel>().unwrap_err().to_string(),
        "[flue] use_model() options thinkingLevel must be one of: off, minimal, low, medium, high, xhigh, max."
    );
}

#[test]
fn model_options_from_configuration_reject_unknown_fields_with_the_reference_messages() {
    use serde_json::json;
    let parse = |value| ModelOptions::from_json(&value);
    assert_eq!(parse(json!([])).unwrap_err(), ModelOptionsError::NotAnObject);
    assert_eq!(
        parse(json!({"temperature": 1})).unwrap_err().to_string(),
        "[flue] use_model() options received unknown field \"temperature\"."
    );
    assert_eq!(
        parse(json!({"compaction": true})).unwrap_err().to_string(),
        "[flue] use_model() options compaction must be a configuration object or `false`."
    );
    assert_eq!(
        parse(json!({"compaction": {"reserve": 1}})).unwrap_err().to_string(),
        "[flue] use_model() options compaction received unknown field \"reserve\"."
    );
    assert_eq!(
        parse(json!({"compaction": {"reserveTokens": -1}}))
            .unwrap_err()
            .to_string(),
        "[flue] use_model() options compaction.reserveTokens must be a non-negative integer."
    );
    assert_eq!(
        parse(json!({"compaction": {"model": 5}})).unwrap_err().to_string(),
        "[flue] use_model() options compaction.model must be a string."
    );
    assert_eq!(
        parse(json!({"thinkingLevel": "huge"})).unwrap_err().to_string(),
        "[flue] use_model() options thinkingLevel must be one of: off, minimal, low, medium, high, xhigh, max."
    );
    assert_eq!(
        parse(json!({"compaction": false})).unwrap().compaction,
        Compaction::Disabled
    );
    let options =
        parse(json!({"thinkingLevel": "max", "compaction": {"reserveTokens": 0, "keepRecentTokens": 8000}})).unwrap();
    assert_eq!(options.thinking_level, Some(ThinkingLevel::Max));
    assert_eq!(
        options.compaction,
        Compaction::Threshold(CompactionConfig {
            reserve_tokens: Some(0),
            keep_recent_tokens: Some(8000),
            model: None
        })
    );
}

#[test]
fn model_options_from_configuration_check_in_the_reference_order() {
    use serde_json::json;
    let message = |value| ModelOptions::from_json(&value).unwrap_err().to_string();
    // Every key before any value: an unknown key sorted after a bad compaction is still named.
    assert_eq!(
        message(json!({"compaction": 5, "temperature": 1})),
        "[flue] use_model() options received unknown field \"temperature\"."
    );
    // The thinking level before compaction.
    assert_eq!(
        message(json!({"compaction": 5, "thinkingLevel": "huge"})),
        "[flue] use_model() options thinkingLevel must be one of: off, minimal, low, medium, high, xhigh, max."
    );
    // Inside compaction: every key, then reserveTokens, keepRecentTokens and model.
    assert_eq!(
        message(json!({"compaction": {"keepRecentTokens": -1, "zeal": 1}})),
        "[flue] use_model() options compaction received unknown field \"zeal\"."
    );
    assert_eq!(
        message(json!({"compaction": {"keepRecentTokens": -1, "reserveTokens": "x"}})),
        "[flue] use_model() options compaction.reserveTokens must be a non-negative integer."
    );
    assert_eq!(
        message(json!({"compaction": {"model": 5, "keepRecentTokens": 1.5}})),
        "[flue] use_model() options compaction.keepRecentTokens must be a non-negative integer."
    );
}

#[test]
fn model_options_take_every_non_negative_integer_token_count_as_the_reference_does() {
    use serde_json::json;
    let threshold = |compaction| match ModelOptions::from_json(&json!({ "compaction": compaction })) {
        Ok(ModelOptions {
            compaction: Compaction::Threshold(config),
            ..
        }) => config,
        other => panic!("expected a threshold compaction, got {other:?}"),
    };
    // A whole number written with a fraction is an integer.
    let config = threshold(json!({"reserveTokens": 16000.0, "keepRecentTokens": -0.0}));
    assert_eq!(
        (config.reserve_tokens, config.keep_recent_tokens),
        (Some(16_000), Some(0))
    );
    // Past u32: held as u32::MAX, past every context window all the same.
    let config = threshold(json!({"reserveTokens": 5_000_000_000u64, "keepRecentTokens": 1e12}));
    assert_eq!(
        (config.reserve_tokens, config.keep_recent_tokens),
        (Some(u32::MAX), Some(u32::MAX))
    );
    for bad in [json!(0.5), json!(-1.0), json!(-3), json!(null), json!("8000")] {
        assert_eq!(
            ModelOptions::from_json(&json!({"compaction": {"reserveTokens": bad}})).unwrap_err(),
            ModelOptionsError::CompactionTokens("reserveTokens"),
            "{bad}"
        );
    }
}

// ---- use_sandbox --------------------------------------------------------------------------

#[test]
fn use_sandbox_called_twice_in_one_render_panics() {
    let agent = agent(|_| {
        use_model("openai/gpt-4o");
        use_sandbox(NoSandbox);
        use_sandbox(NoSandbox);
    });
    assert_eq!(
        render_panic(&agent),
        "[flue] use_sandbox() was called twice in one render. An agent has one environment — attach it once, in the agent body or a single custom hook."
    );
}

#[test]
fn use_sandbox_rejects_an_empty_cwd_and_records_a_given_one() {
    let empty = agent(|_| use_sandbox_with(NoSandbox, SandboxOptions::cwd("")));
    assert_eq!(
        render_panic(&empty),
        "[flue] use_sandbox() options.cwd must be a non-empty string."
    );
    let scoped = agent(|_| use_sandbox_with(NoSandbox, SandboxOptions::cwd("/workspace/app")));
    let sandbox = flue_core::render_bare(&scoped).unwrap().sandbox.unwrap();
    assert_eq!(sandbox.cwd.as_deref(), Some("/workspace/app"));
}

// ---- duplicate names ----------------------------------------------------------------------

#[test]
fn duplicate_tool_names_fail_after_the_render_with_tool_name_conflict_error() {
    let agent = agent(|_| {
        use_model("openai/gpt-4o");
        use_tool(echo_tool("lookup"));
        use_instruction("the body keeps running after the duplicate mount");
        use_tool(echo_tool("lookup"));
    });
    let error = flue_core::render_bare(&agent).unwrap_err();
    let RenderError::ToolNameConflict(conflict) = &error else {
        panic!("unexpected {error:?}")
    };
    assert_eq!(conflict.name(), "lookup");
    assert_eq!(conflict.conflict(), ToolNameConflict::Duplicate);
    assert_eq!(error.to_string(), "Duplicate tool name \"lookup\".");
}

#[test]
fn duplicate_skill_names_panic_at_the_second_mount() {
    let agent = agent(|_| {
        let skill = Skill::new("triage", "Triage issues.", "Steps.").unwrap();
        use_skill(&skill);
        use_skill(skill);
    });
    assert_eq!(
        render_panic(&agent),
        "[flue] use_skill() mounted the skill name \"triage\" twice in one render. Each skill mounts once; share it from a single custom hook."
    );
}

#[test]
fn duplicate_subagent_names_panic_at_the_second_declaration() {
    let agent = agent(|_| {
        use_subagent(Subagent::general());
        use_subagent(Subagent::general());
    });
    assert_eq!(
        render_panic(&agent),
        "[flue] use_subagent() declared the subagent name \"flue-general\" twice in one render. Each delegate declares once; share it from a single custom hook."
    );
}

#[test]
fn duplicate_state_names_panic_at_the_second_call() {
    let agent = agent(|_| {
        let _ = use_persistent_state("phase", 0);
        let _ = use_persistent_state("phase", 1);
    });
    assert_eq!(
        render_panic(&agent),
        "[flue] Duplicate use_persistent_state name \"phase\" in one render. State names identify a value across renders and must be unique."
    );
}

#[test]
fn duplicate_data_part_names_panic_at_the_second_call() {
    let agent = agent(|_| {
        let _ = use_data_writer::<u32>("progress");
        let _ = use_data_writer::<String>("progress");
    });
    assert_eq!(
        render_panic(&agent),
        "[flue] Duplicate use_data_writer name \"progress\" in one render. Data part names identify a part within the response and must be unique."
    );
}

#[test]
fn duplicate_mcp_server_names_panic_at_the_second_declaration() {
    let agent = agent(|_| {
        use_mcp_connection(McpConnection::new("linear", "https://mcp.linear.app/mcp"));
        use_mcp_connection(McpConnection::new("linear", "https://mcp.linear.app/other"));
    });
    assert_eq!(
        render_panic(&agent),
        "[flue] use_mcp_connection() declared the MCP server name \"linear\" twice in one render. Each server declares once; share it from a single custom hook."
    );
}

#[test]
fn blank_state_and_data_part_names_are_rejected() {
    let state = agent(|_| drop(use_persistent_state("", 0)));
    assert_eq!(
        render_panic(&state),
        "[flue] use_persistent_state(name, default) takes the state name as its first argument — a non-empty string."
    );
    let data = agent(|_| drop(use_data_writer::<u8>("")));
    assert_eq!(
        render_panic(&data),
        "[flue] use_data_writer(name) takes the data part name as its first argument — a non-empty string."
    );
}

#[test]
fn invalid_subagent_and_mcp_definitions_are_rejected_at_the_mount_site() {
    let nameless = agent(|_| use_subagent(Subagent::new(" ", "d", Subagent::general().agent().clone())));
    assert_eq!(
        render_panic(&nameless),
        "[flue] use_subagent() name must be a non-empty string."
    );
    let undescribed = agent(|_| use_subagent(Subagent::new("helper", "", Subagent::general().agent().clone())));
    assert_eq!(
        render_panic(&undescribed),
        "[flue] use_subagent() \"helper\" needs a non-empty description — it is the catalog line the model uses to decide when to delegate."
    );
    let blank_model = agent(|_| use_subagent(Subagent::general().model("")));
    assert_eq!(
        render_panic(&blank_model),
        "[flue] use_subagent() \"flue-general\" model must be a non-empty string."
    );
    let bad_url = agent(|_| use_mcp_connection(McpConnection::new("linear", "mcp.linear.app")));
    assert_eq!(
        render_panic(&bad_url),
        "[flue] use_mcp_connection() \"linear\" url \"mcp.linear.app\" is not a valid absolute URL."
    );
    // A server name that would leave its tools' mounted names (64 characters at most) no room.
    let long_name = agent(|_| use_mcp_connection(McpConnection::new("s".repeat(57), "https://mcp.example.com")));
    assert_eq!(
        render_panic(&long_name),
        format!(
            "[flue] use_mcp_connection() \"{}…\" name is 57 characters; at most 56 leave room for its tools' names (mounted as mcp__<server>__<tool>, at most 64 characters).",
            "s".repeat(56)
        )
    );
    let longest = agent(|_| {
        use_model("openai/gpt-4o");
        use_mcp_connection(McpConnection::new("s".repeat(56), "https://mcp.example.com"));
        "ok"
    });
    let rendered = flue_core::render_bare(&longest);
    assert!(rendered.is_ok(), "56 characters are allowed: {:?}", rendered.err());
}

#[test]
fn an_invalid_mcp_url_is_quoted_without_its_userinfo_query_and_fragment() {
    // The message reaches the submission's failure and the records: a token in the URL stays out.
    for (url, quoted) in [
        ("mcp.linear.app/mcp?token=s3cret#frag", "mcp.linear.app/…"),
        (
            "https://user:s3cret@mcp.linear.app /mcp?key=s3cret",
            "https://mcp.linear.app /…",
        ),
        // A key in the path (read from a file with its line end) is not quoted either.
        ("https://mcp.linear.app/s/s3cret\n/mcp", "https://mcp.linear.app/…"),
        ("//s3cret@mcp.linear.app#s3cret", "//mcp.linear.app"),
        ("bad?token=s3cret://mcp.linear.app", "bad"),
    ] {
        let bad_url = agent(move |_| use_mcp_connection(McpConnection::new("linear", url)));
        let message = render_panic(&bad_url);
        assert_eq!(
            message,
            format!("[flue] use_mcp_connection() \"linear\" url {quoted:?} is not a valid absolute URL."),
            "{url}"
        );
        assert!(!message.contains("s3cret"), "{message}");
    }
}

#[test]
fn use_hooks_rejects_selecting_one_hook_twice() {
    use flue_core::lifecycle::{ThreadHook, ThreadHookDefinition, ThreadHookHandler};
    static REDACT: ThreadHookDefinition = ThreadHookDefinition {
        id: "redact_emails",
        handler: ThreadHookHandler::BeforeStoreToolResult(|_, _, result| Box::pin(async move { Ok(result) })),
    };
    let hook = ThreadHook::new(&REDACT);
    let twice = agent(move |_| use_hooks([hook, hook]));
    assert_eq!(
        render_panic(&twice),
        "[flue] use_hooks() selected the lifecycle hook \"redact_emails\" twice in one render. Select each hook once; hooks of one kind run in listed order."
    );
    // Another hook under the same id: two hooks share the id, whatever the render meant.
    static OTHER_REDACT: ThreadHookDefinition = ThreadHookDefinition {
        id: "redact_emails",
        handler: ThreadHookHandler::AfterThreadCreated(|_| Box::pin(async { Ok(()) })),
    };
    let other = ThreadHook::new(&OTHER_REDACT);
    let clash = agent(move |_| use_hooks([hook, other]));
    assert_eq!(
        render_panic(&clash),
        "[flue] Two lifecycle hooks share the id \"redact_emails\" (before_store_tool_result and after_thread_created); hook ids must be unique across the application."
    );
    // A hook defined by hand under an id `#[hook]` would refuse.
    static SHOUTING: ThreadHookDefinition = ThreadHookDefinition {
        id: "Redact",
        handler: ThreadHookHandler::AfterThreadCreated(|_| Box::pin(async { Ok(()) })),
    };
    let shouting = ThreadHook::new(&SHOUTING);
    assert_eq!(
        render_panic(&agent(move |_| use_hooks([shouting]))),
        "[flue] The lifecycle hook id \"Redact\" must be snake_case: lowercase letters, digits and underscores, starting with a letter."
    );
    let once = agent(move |_| use_hooks([hook]));
    let rendered = flue_core::render_bare(&once).unwrap();
    assert_eq!(
        rendered.hooks.iter().map(ThreadHook::id).collect::<Vec<_>>(),
        ["redact_emails"]
    );
}

// ---- subagent renders ---------------------------------------------------------------------

static REDACT_IN_DELEGATE: flue_core::lifecycle::ThreadHookDefinition = flue_core::lifecycle::ThreadHookDefinition {
    id: "redact_in_delegate",
    handler: flue_core::lifecycle::ThreadHookHandler::BeforeStoreToolResult(|_, _, result| {
        Box::pin(async move { Ok(result) })
    }),
};

#[test]
fn use_subagent_refuses_an_agent_whose_definition_selects_lifecycle_hooks() {
    let hooked: AgentRef = FnAgent::new(
        AgentDefinition::new("hooked").hooks(vec![flue_core::lifecycle::ThreadHook::new(&REDACT_IN_DELEGATE)]),
        |_: AgentProps<'_>| "You look customers up.",
    )
    .into();
    let parent = agent(move |_| use_subagent(Subagent::new("hooked", "Looks customers up.", hooked.clone())));
    assert_eq!(
        render_panic(&parent),
        "[flue] use_subagent() \"hooked\": its agent selects lifecycle hooks (redact_in_delegate), which a delegate's session does not run. Delegate to an agent without them, or do that work in the parent's hooks."
    );
}

/// Standard Agents §4.3 (checklist 57, 58): parent-hook requirements fail closed, for an agent
/// built without `#[agent]` (which checks them at compile time) too; so do the rest of the
/// compile-time rules, as a delegate need not be registered with the runtime.
#[test]
fn use_subagent_refuses_a_hand_built_delegate_that_breaks_a_compile_time_rule() {
    let requirement = |reason: &'static str| flue_core::agent::ParentHookRequirement {
        hook: flue_core::lifecycle::ThreadHook::new(&REDACT_IN_DELEGATE),
        stage: HookStage::AfterParent,
        reason,
    };
    static SHOUTING: flue_core::lifecycle::ThreadHookDefinition = flue_core::lifecycle::ThreadHookDefinition {
        id: "Redact",
        handler: flue_core::lifecycle::ThreadHookHandler::AfterThreadCreated(|_| Box::pin(async { Ok(()) })),
    };
    let cases: [(AgentDefinition, &str); 5] = [
        (
            AgentDefinition::new("child").max_steps(0),
            "[flue] use_subagent() \"child\": Agent \"child\": max_steps must be a positive integer.",
        ),
        (
            AgentDefinition::new("child").expose_as_tool().parent_hooks(vec![
                flue_core::agent::ParentHookRequirement {
                    hook: flue_core::lifecycle::ThreadHook::new(&SHOUTING),
                    stage: HookStage::AfterParent,
                    reason: "Redacts.",
                },
            ]),
            "[flue] use_subagent() \"child\": The lifecycle hook id \"Redact\" must be snake_case: lowercase letters, digits and underscores, starting with a letter.",
        ),
        (
            AgentDefinition::new("child").parent_hooks(vec![requirement("Redacts.")]),
            "[flue] use_subagent() \"child\": its agent declares parent hooks but is not exposed as a tool; only an agent with expose_as_tool can require hooks of its parents.",
        ),
        (
            AgentDefinition::new("child")
                .expose_as_tool()
                .parent_hooks(vec![requirement(" ")]),
            "[flue] use_subagent() \"child\": its agent's parent hook redact_in_delegate needs a non-blank reason.",
        ),
        (
            AgentDefinition::new("child")
                .expose_as_tool()
                .parent_hooks(vec![requirement("Redacts."), requirement("Again.")]),
            "[flue] use_subagent() \"child\": its agent requires the parent hook redact_in_delegate twice; require each hook once.",
        ),
    ];
    for (definition, message) in cases {
        let child: AgentRef = FnAgent::new(definition, |_: AgentProps<'_>| "You redact.").into();
        let parent = agent(move |_| use_subagent(Subagent::new("child", "Redacts.", child.clone())));
        assert_eq!(render_panic(&parent), message);
    }
    // Exposed, with one reasoned requirement: mounted.
    let child: AgentRef = FnAgent::new(
        AgentDefinition::new("child")
            .expose_as_tool()
            .parent_hooks(vec![requirement("Redacts.")]),
        |_: AgentProps<'_>| "You redact.",
    )
    .into();
    let parent = agent(move |_| use_subagent(Subagent::new("child", "Redacts.", child.clone())));
    assert!(flue_core::render(&parent, &RenderState::bare()).is_ok());
}

#[test]
fn instance_scoped_and_client_facing_hooks_panic_in_a_subagent_render() {
    type Case = (&'static str, Box<dyn Fn() + Send + Sync>);
    let cases: Vec<Case> = vec![
        (
            "[flue] use_model() is not available in a subagent render. A delegate declares its model on its use_subagent() definition.",
            Box::new(|| use_model("openai/gpt-4o")),
        ),
        (
            "[flue] use_sandbox() is not available in a subagent render. Delegates share the parent agent's environment (scope work with the task call's cwd instead).",
            Box::new(|| use_sandbox(NoSandbox)),
        ),
        (
            "[flue] use_mcp_connection() is not available in a subagent render. Declare the connection on the root agent and give the delegate what it needs through the parent's tools.",
            Box::new(|| use_mcp_connection(McpConnection::new("s", "https://mcp.example.com"))),
        ),
        (
            "[flue] use_persistent_state() is not available in a subagent render. Durable state is scoped to the agent instance; delegates run detached tasks with no state channel. Pass what the delegate needs through the task prompt instead.",
            Box::new(|| drop(use_persistent_state("n", 0))),
        ),
        (
            "[flue] use_data_writer() is not available in a subagent render. Data parts stream to the agent's public conversation; delegates run detached tasks with no client-facing output. Return what the delegate produced as its task result instead.",
            Box::new(|| drop(use_data_writer::<u8>("d"))),
        ),
        (
            "[flue] use_dispatch_message() is not available in a subagent render. A delegate has no instance of its own to dispatch to — return what it produced as its task result instead.",
            Box::new(|| drop(use_dispatch_message())),
        ),
        (
            "[flue] use_agent_start() is not available in a subagent render. Lifecycle hooks run against the root agent's durable record log; a delegate runs a detached task — do its up-front work in the task itself.",
            Box::new(|| use_agent_start(|_| async {})),
        ),
        (
            "[flue] use_agent_finish() is not available in a subagent render. Lifecycle hooks run against the root agent's durable record log; a delegate's contract is its task result — validate it in the parent.",
            Box::new(|| use_agent_finish(|_| async {})),
        ),
        (
            "[flue] use_response_start() is not available in a subagent render. Response metadata decorates the agent's public conversation; delegates run detached tasks with no client-facing output.",
            Box::new(|| use_response_start(|_| ())),
        ),
        (
            "[flue] use_response_finish() is not available in a subagent render. Response metadata decorates the agent's public conversation; delegates run detached tasks with no client-facing output.",
            Box::new(|| use_response_finish(|_| ())),
        ),
        (
            "[flue] use_hooks() is not available in a subagent render. Lifecycle hooks run against the root agent's conversation; a delegate's session runs none — shape what it sees in its tools, and check its result in the parent.",
            Box::new(|| use_hooks([flue_core::lifecycle::ThreadHook::new(&REDACT_IN_DELEGATE)])),
        ),
    ];
    for (expected, call) in cases {
        let call = Arc::new(call);
        let delegate = agent(move |_| call());
        assert_eq!(subagent_render_panic(&delegate), expected);
    }
}

#[test]
fn use_initial_data_degrades_to_none_and_use_delivery_reads_the_task_prompt_in_a_subagent_render() {
    let delegate = agent(|_| {
        let data: Option<serde_json::Value> = use_initial_data();
        format!("{data:?} / {}", use_delivery().body())
    });
    let prompt = Arc::new(DeliveredMessage::user("Summarise the mailbox."));
    let initial = serde_json::json!({"plan": "pro"});
    let state = RenderState::subagent(&prompt).with_initial_data(&initial);
    let rendered = flue_core::render(&delegate, &state).unwrap();
    assert_eq!(rendered.instruction.as_deref(), Some("None / Summarise the mailbox."));
}

#[test]
fn tools_skills_instructions_and_nested_subagents_compose_in_a_subagent_render() {
    let delegate = agent(|_| {
        use_tool(echo_tool("grep_mail"));
        use_skill(Skill::new("summarise", "Summarise text.", "Write three bullets.").unwrap());
        use_subagent(Subagent::general());
        use_instruction("Be brief.");
        "You read mail."
    });
    let prompt = Arc::new(DeliveredMessage::user("go"));
    let rendered = flue_core::render(&delegate, &RenderState::subagent(&prompt)).unwrap();
    assert_eq!(rendered.tools.len(), 1);
    assert_eq!(rendered.skills.len(), 1);
    assert_eq!(rendered.subagents.len(), 1);
    assert_eq!(rendered.instruction.as_deref(), Some("You read mail.\n\nBe brief."));
    assert!(rendered.model.is_none());
}

// ---- data-writer identity across renders -----------------------------------------------------

#[test]
fn data_writer_names_must_be_identical_on_consecutive_renders() {
    let flag = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let agent = {
        let flag = flag.clone();
        agent(move |_| {
            use_model("openai/gpt-4o");
            let _progress = use_data_writer::<u32>("progress");
            match flag.load(std::sync::atomic::Ordering::SeqCst) {
                0 => {
                    let _ = use_data_writer::<String>("status");
                }
                1 => {
                    let _ = use_data_writer::<String>("summary");
                    let _ = use_data_writer::<String>("citations");
                }
                _ => {
                    let _ = use_data_writer::<String>("status");
                }
            }
        })
    };
    let first = flue_core::render_bare(&agent).unwrap();
    let previous = first.data_writer_names();
    flag.store(1, std::sync::atomic::Ordering::SeqCst);
    let error = flue_core::render(&agent, &RenderState::bare().with_previous_data_writers(&previous)).unwrap_err();
    assert_eq!(
        error,
        RenderError::IdentityChanged {
            added: vec!["summary".into(), "citations".into()],
            removed: vec!["status".into()]
        }
    );
    assert_eq!(
        error.to_string(),
        "[flue] The agent's render changed identity between turns: message data added summary, citations; removed status. Message data must be declared unconditionally on every render — the named parts are the response's client-facing identity. Resources (tools, skills, subagents), persisted state, event hooks, and the sandbox may all be conditional."
    );
    flag.store(2, std::sync::atomic::Ordering::SeqCst);
    assert!(flue_core::render(&agent, &RenderState::bare().with_previous_data_writers(&previous)).is_ok());
}

#[test]
fn data_writer_identity_compares_sets_so_reordering_is_allowed() {
    let flip = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let agent = {
        let flip = flip.clone();
        agent(move |_| {
            let (a, b) = if flip.load(std::sync::atomic::Ordering::SeqCst) {
                ("b", "a")
            } else {
                ("a", "b")
            };
            let _ = use_data_writer::<u8>(a);
            let _ = use_data_writer::<u8>(b);
        })
    };
    let previous = flue_core::render_bare(&agent).unwrap().data_writer_names();
    flip.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(flue_core::render(&agent, &RenderState::bare().with_previous_data_writers(&previous)).is_ok());
}

// ---- tool definitions ---------------------------------------------------------------------

#[test]
fn inline_tools_reject_invalid_names_and_non_object_arguments() {
    let invalid = common::panic_message_of(|| echo_tool("has space"));
    assert_eq!(
        invalid,
        "[flue] Tool::new() name \"has space\" must match ^[A-Za-z0-9_-]{1,64}$ (what every provider accepts)."
    );
    let undescribed =
        common::panic_message_of(|| Tool::new("x").run(|_ctx, _: serde_json::Map<String, serde_json::Value>| async {}));
    assert_eq!(
        undescribed,
        "[flue] Tool::new() description must be a non-empty string."
    );
    let scalar = common::panic_message_of(|| {
        Tool::new("x")
            .description("d")
            .run(|_ctx, n: u32| async move { n.to_string() })
    });
    assert_eq!(scalar, "[flue] Tool::new() input must be a top-level object schema.");
}

/// A handler the way `#[tool]` expands one: its definition is built unchecked
/// (`ToolDefinition::from_checked`), so nothing has looked at its argument schema yet.
struct UncheckedTool(flue_core::tool::ToolDefinition);

impl flue_core::tool::ToolHandler for UncheckedTool {
    fn definition(&self) -> &flue_core::tool::ToolDefinition {
        &self.0
    }

    fn call(&self, _ctx: ToolContext, _args: serde_json::Value) -> flue_core::BoxFuture<'_, ToolOutput> {
        Box::pin(std::future::ready(ToolOutput::text("")))
    }
}

#[derive(serde::Deserialize, schemars::JsonSchema)]
#[allow(dead_code)]
struct CountArgs {
    count: u32,
}

#[test]
fn use_tool_checks_a_handlers_argument_schema_as_the_reference_use_tool_does() {
    use flue_core::data::{SchemaSource, tool_input_schema_of};
    use flue_core::tool::ToolDefinition;
    // `#[tool] async fn echo(args: String)`: a scalar schema, not an object.
    let scalar = agent(|_| {
        use_model("openai/gpt-4o");
        use_tool(UncheckedTool(ToolDefinition::from_checked(
            "echo",
            "Echo.",
            SchemaSource::Typed(tool_input_schema_of::<String>),
            None,
            &[],
            false,
        )));
    });
    assert_eq!(
        render_panic(&scalar),
        "[flue] use_tool() input must be a top-level object schema."
    );
    // `#[tool(progress_argument = "count")] async fn count(count: u32)`: not a string.
    let numeric_progress = agent(|_| {
        use_model("openai/gpt-4o");
        use_tool(UncheckedTool(ToolDefinition::from_checked(
            "count",
            "Count.",
            SchemaSource::Typed(tool_input_schema_of::<CountArgs>),
            Some("count"),
            &[],
            false,
        )));
    });
    assert_eq!(
        render_panic(&numeric_progress),
        "[flue] use_tool() \"count\" progress_argument \"count\" must be a string argument."
    );
    // A handler's name and description are checked too: a reserved name would shadow the
    // framework's own tool.
    let unchecked = |name: &'static str, description: &'static str| {
        UncheckedTool(ToolDefinition::from_checked(
            name,
            description,
            SchemaSource::Typed(tool_input_schema_of::<CountArgs>),
            None,
            &[],
            false,
        ))
    };
    for (name, description, message) in [
        (
            "two words",
            "Count.",
            "[flue] use_tool() name \"two words\" must match ^[A-Za-z0-9_-]{1,64}$ (what every provider accepts).",
        ),
        (
            "count",
            " ",
            "[flue] use_tool() description must be a non-empty string.",
        ),
    ] {
        let bad = agent(move |_| {
            use_model("openai/gpt-4o");
            use_tool(unchecked(name, description));
        });
        assert_eq!(render_panic(&bad), message, "{name}");
    }
}

/// Reference: a custom tool using a name the framework reserves (`task`, `activate_skill`, …)
/// is a `ToolNameConflictError` where the render's tools are assembled, as a duplicate name is:
/// an inline tool, a hand-written handler, mounted conditionally or not.
#[test]
fn a_tool_with_a_reserved_name_fails_the_render_with_a_tool_name_conflict() {
    for name in flue_core::tool::RESERVED_TOOL_NAMES {
        let inline = agent(move |_| {
            use_model("openai/gpt-4o");
            use_tool(echo_tool("echo"));
            use_tool(echo_tool(name));
        });
        match flue_core::render_bare(&inline) {
            Err(flue_core::RenderError::ToolNameConflict(conflict)) => {
                assert_eq!(conflict.conflict(), flue_core::ToolNameConflict::Reserved, "{name}");
                assert_eq!(
                    conflict.to_string(),
                    format!("Tool name \"{name}\" is reserved by the framework.")
                );
            }
            other => panic!("{name}: {:?}", other.map(|_| ())),
        }
    }
    let handler = agent(|_| {
        use_model("openai/gpt-4o");
        use_tool(UncheckedTool(flue_core::tool::ToolDefinition::from_checked(
            "finish",
            "Finish.",
            flue_core::data::SchemaSource::Typed(flue_core::data::tool_input_schema_of::<CountArgs>),
            None,
            &[],
            false,
        )));
    });
    assert!(matches!(
        flue_core::render_bare(&handler),
        Err(flue_core::RenderError::ToolNameConflict(conflict)) if conflict.conflict() == flue_core::ToolNameConflict::Reserved
    ));
}

// ---- use_hooks --------------------------------------------------------------------------------

#[test]
fn use_hooks_accepts_a_lazy_selection_that_itself_calls_hooks() {
    // A custom hook may compute the selection lazily, calling other hooks as it goes; the
    // selection is consumed before `use_hooks` records anything, as the reference's array is.
    let agent = agent(|_| {
        use_model("openai/gpt-4o");
        use_hooks(std::iter::from_fn(|| {
            use_instruction("Chosen while selecting hooks.");
            None
        }));
    });
    assert_eq!(
        flue_core::render_bare(&agent).unwrap().instruction.as_deref(),
        Some("Chosen while selecting hooks.")
    );
}
