//! Skills through the runtime: the catalog in the system prompt, `activate_skill`,
//! `read_skill_resource`, and skills embedded from a `SKILL.md` directory (issue 8, item 2).
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use flue_runtime::prelude::*;
use flue_runtime::testing::{ScriptedModel, ScriptedReply};
use serde_json::json;

mod harness;
use harness::{runtime_with, tool_results};

#[agent]
fn support() -> &'static str {
    use_model("scripted/x");
    use_skill(flue_runtime::skill!("skills/refunds", files = ["POLICY.md"]));
    use_skill(
        Skill::new(
            "escalation",
            "Hand the case to a human. Use when the customer asks for one.",
            "Summarize the case and say a specialist will follow up.",
        )
        .unwrap(),
    );
    "Answer support questions."
}

#[tokio::test]
async fn skills_are_cataloged_activated_as_tool_results_and_their_files_read_on_demand() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([
            ("activate_skill", json!({"name": "refunds"})),
            ("activate_skill", json!({"name": "billing"})),
        ]),
        ScriptedReply::tool_call(
            "read_skill_resource",
            json!({"skill": "refunds", "path": "POLICY.md", "limit": 1}),
        ),
        ScriptedReply::text("Refunds are granted within 30 days."),
    ]);
    let runtime = runtime_with(&model, [support.into()]);
    let reply = runtime.init(&support, "s").send("Can I get a refund?").await.unwrap();
    assert_eq!(reply.text, "Refunds are granted within 30 days.");
    let requests = model.requests();

    // One catalog line per skill; the full instructions are not in the prompt.
    let system = requests[0].system.as_deref().unwrap();
    assert!(
        system.starts_with("Answer support questions.\n\n## Available Skills"),
        "{system}"
    );
    assert!(
        system.contains("- **refunds** — Process a customer refund request end to end."),
        "{system}"
    );
    assert!(
        system.contains("- **escalation** — Hand the case to a human."),
        "{system}"
    );
    assert!(!system.contains("Follow this procedure"), "{system}");
    let tools: Vec<&str> = requests[0].tools.iter().map(|tool| &*tool.name).collect();
    assert_eq!(tools, ["activate_skill", "read_skill_resource", "task"]);

    let activated = tool_results(&requests[1]);
    assert!(
        activated[0]
            .0
            .starts_with("Follow this procedure for every refund request:"),
        "{activated:?}"
    );
    assert!(
        activated[0].0.ends_with("skill \"refunds\"):\n- POLICY.md"),
        "{activated:?}"
    );
    assert_eq!(
        activated[1],
        (
            "No skill named \"billing\" is available. Available skills: refunds, escalation.".to_owned(),
            false
        )
    );
    assert_eq!(
        requests[1].system, requests[0].system,
        "activation leaves the system prompt as it was"
    );
    let read = tool_results(&requests[2]);
    assert_eq!(
        read[2].0,
        "Refunds are granted within 30 days of delivery.\n\n[Showing lines 1-1 of 2. Continue with offset 2.]"
    );
}

#[agent]
fn no_files() -> &'static str {
    use_model("scripted/x");
    use_skill(Skill::new("greet", "Greets.", "Say hello.").unwrap());
    "Hi."
}

#[tokio::test]
async fn read_skill_resource_is_mounted_only_when_a_skill_has_files() {
    let model = ScriptedModel::new([ScriptedReply::text("hello")]);
    let runtime = runtime_with(&model, [no_files.into()]);
    runtime.init(&no_files, "n").send("hi").await.unwrap();
    let tools: Vec<String> = model.requests()[0]
        .tools
        .iter()
        .map(|tool| tool.name.to_string())
        .collect();
    assert_eq!(tools, ["activate_skill", "task"]);
}

#[test]
fn an_invalid_embedded_skill_names_its_problem() {
    let error = Skill::from_skill_md(
        Some("skills/refunds"),
        "---\nname: refund\ndescription: d\n---\nbody",
        [],
    )
    .unwrap_err();
    assert_eq!(
        error.to_string(),
        "Skill definition is invalid: name: Must match the skill's directory name \"refunds\"."
    );
}
