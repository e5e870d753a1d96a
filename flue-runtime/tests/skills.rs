//! Skills through the runtime: the catalog in the system prompt, `activate_skill`,
//! `read_skill_resource`, skills embedded from a `SKILL.md` directory (issue 8, item 2), and
//! workspace skills discovered in the sandbox's `.agents/skills/` (reference row 20).
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use flue_runtime::prelude::*;
use flue_runtime::sandbox;
use flue_runtime::testing::{ScriptedModel, ScriptedReply};
use serde_json::json;

mod harness;
mod scratch;
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
            "Skill \"billing\" is not available. Available skills: refunds, escalation.".to_owned(),
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

// ---- workspace skills: `.agents/skills/<name>/SKILL.md` in the sandbox's cwd -------------------

/// Writes `files` (path relative to `root` → contents) under `root`.
fn write_tree(root: &std::path::Path, files: &[(&str, &[u8])]) {
    for (path, contents) in files {
        let path = root.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, contents).unwrap();
    }
}

/// The names of the tools a request offers, in order.
fn tool_names(request: &flue_runtime::provider::ModelRequest) -> Vec<String> {
    request.tools.iter().map(|tool| tool.name.to_string()).collect()
}

const TRIAGE: &str = "---\nname: triage\ndescription: Sort incoming bug reports. Use when a report arrives.\n---\nLabel the report, then follow references/checklist.md.";

static WORKSPACE_ROOT: std::sync::LazyLock<std::path::PathBuf> = std::sync::LazyLock::new(|| {
    let root = scratch::dir("workspace-skills");
    write_tree(
        &root,
        &[
            ("work/.agents/skills/triage/SKILL.md", TRIAGE.as_bytes()),
            (
                "work/.agents/skills/triage/references/checklist.md",
                b"1. Reproduce.\n2. Label.",
            ),
            // A directory without a SKILL.md, and a file: neither is a skill, and neither warns.
            ("work/.agents/skills/scratchpad/README.md", b"not a skill"),
            ("work/.agents/skills/README.md", b"Skills of this repository."),
            (
                "work/shared/handover/SKILL.md",
                b"---\nname: handover\ndescription: Hand a report over to another team.\n---\nName the team.",
            ),
        ],
    );
    // A skill installed as a link to its directory.
    std::os::unix::fs::symlink("../../shared/handover", root.join("work/.agents/skills/handover")).unwrap();
    root
});

#[agent]
fn workspace_support() -> &'static str {
    use_model("scripted/x");
    use_sandbox_with(sandbox::local(WORKSPACE_ROOT.clone()), SandboxOptions::cwd("/work"));
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
async fn a_workspace_skill_is_cataloged_after_the_declared_ones_and_activates_from_the_sandbox() {
    let logs = harness::logs::capture();
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("activate_skill", json!({"name": "triage"})),
        ScriptedReply::tool_call("read", json!({"path": ".agents/skills/triage/references/checklist.md"})),
        ScriptedReply::text("Labelled."),
    ]);
    let runtime = runtime_with(&model, [workspace_support.into()]);
    let reply = runtime
        .init(&workspace_support, "w")
        .send("A bug report came in.")
        .await
        .unwrap();
    assert_eq!(reply.text, "Labelled.");
    let requests = model.requests();

    // Declared skills first, then the discovered one; one catalog line each, nothing more.
    let system = requests[0].system.as_deref().unwrap();
    let catalog = &system[system.find("## Available Skills").expect(system)..];
    let escalation = catalog
        .find("- **escalation** — Hand the case to a human.")
        .expect(catalog);
    let triage = catalog
        .find("- **triage** — Sort incoming bug reports. Use when a report arrives.")
        .expect(catalog);
    assert!(escalation < triage, "{catalog}");
    assert!(
        catalog.contains("- **handover** — Hand a report over to another team."),
        "{catalog}"
    );
    assert!(!system.contains("Label the report"), "{system}");
    assert!(!system.contains("scratchpad"), "{system}");
    // Its supporting files stay in the sandbox: no `read_skill_resource`.
    assert_eq!(
        tool_names(&requests[0]),
        [
            "read",
            "write",
            "edit",
            "bash",
            "grep",
            "glob",
            "activate_skill",
            "task"
        ]
    );

    let (activated, is_error) = tool_results(&requests[1]).remove(0);
    assert!(!is_error, "{activated}");
    assert!(
        activated.starts_with("Label the report, then follow references/checklist.md."),
        "{activated}"
    );
    assert!(activated.contains("/work/.agents/skills/triage"), "{activated}");
    assert!(
        !activated.contains("Reproduce"),
        "supporting files are read on demand: {activated}"
    );
    assert_eq!(
        tool_results(&requests[2])[1],
        ("1. Reproduce.\n2. Label.".to_owned(), false)
    );
    let lines = logs.all();
    assert!(
        !lines
            .iter()
            .any(|line| line.contains("scratchpad") || line.contains("README")),
        "{lines:?}"
    );
}

static MALFORMED_ROOT: std::sync::LazyLock<std::path::PathBuf> = std::sync::LazyLock::new(|| {
    let root = scratch::dir("workspace-skills-malformed");
    write_tree(
        &root,
        &[
            (
                ".agents/skills/good/SKILL.md",
                b"---\nname: good\ndescription: The one that loads.\n---\nDo good work.",
            ),
            (".agents/skills/frontless/SKILL.md", b"No front matter here."),
            (
                ".agents/skills/misnamed/SKILL.md",
                b"---\nname: other\ndescription: Named after another directory.\n---\nBody.",
            ),
            (".agents/skills/garbled/SKILL.md", b"---\nname: garbled\n\xff\xfe---\n"),
        ],
    );
    // Valid, but larger than a skill may be.
    let huge = format!(
        "---\nname: huge\ndescription: Too big to read.\n---\n{}",
        "word ".repeat(60 * 1024)
    );
    write_tree(&root, &[(".agents/skills/huge/SKILL.md", huge.as_bytes())]);
    root
});

#[agent]
fn malformed_workspace() -> &'static str {
    use_model("scripted/x");
    use_sandbox(sandbox::local(MALFORMED_ROOT.clone()));
    "Work."
}

#[tokio::test]
async fn a_malformed_workspace_skill_is_skipped_with_a_warning_and_the_others_load() {
    let logs = harness::logs::capture();
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([
            ("activate_skill", json!({"name": "good"})),
            ("activate_skill", json!({"name": "frontless"})),
        ]),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [malformed_workspace.into()]);
    let reply = runtime.init(&malformed_workspace, "m").send("go").await.unwrap();
    assert_eq!(reply.text, "done");
    let requests = model.requests();
    let system = requests[0].system.as_deref().unwrap();
    assert!(system.contains("- **good** — The one that loads."), "{system}");
    for skipped in ["frontless", "misnamed", "other", "garbled", "huge"] {
        assert!(!system.contains(&format!("**{skipped}**")), "{system}");
    }
    let results = tool_results(&requests[1]);
    assert!(results[0].0.starts_with("Do good work."), "{results:?}");
    assert_eq!(
        results[1].0,
        "Skill \"frontless\" is not available. Available skills: good."
    );
    let lines = logs.all();
    for (skipped, why) in [
        ("frontless", "SKILL.md must start with a front matter block"),
        ("misnamed", "Must match the skill's directory name \"misnamed\"."),
        ("garbled", "UTF-8"),
        ("huge", "is larger than 256 KiB"),
    ] {
        let prefix = format!("[flue] Skipping invalid workspace skill \"{skipped}\": ");
        assert!(
            lines.iter().any(|line| line.starts_with(&prefix) && line.contains(why)),
            "no warning for {skipped}: {lines:?}"
        );
    }
}

static CROWDED_ROOT: std::sync::LazyLock<std::path::PathBuf> = std::sync::LazyLock::new(|| {
    let root = scratch::dir("workspace-skills-crowded");
    for n in 0..flue_runtime::MAX_WORKSPACE_SKILLS + 5 {
        let name = format!("skill-{n:03}");
        write_tree(
            &root,
            &[(
                &format!(".agents/skills/{name}/SKILL.md"),
                format!("---\nname: {name}\ndescription: Skill number {n}.\n---\nDo thing {n}.").as_bytes(),
            )],
        );
    }
    root
});

#[agent]
fn crowded_workspace() -> &'static str {
    use_model("scripted/x");
    use_sandbox(sandbox::local(CROWDED_ROOT.clone()));
    "Work."
}

#[tokio::test]
async fn a_workspace_provides_at_most_a_hundred_skills_and_warns_of_the_rest() {
    let logs = harness::logs::capture();
    let model = ScriptedModel::new([ScriptedReply::text("done")]);
    let runtime = runtime_with(&model, [crowded_workspace.into()]);
    runtime.init(&crowded_workspace, "c").send("go").await.unwrap();
    let system = model.requests()[0].system.clone().unwrap();
    assert!(system.contains("**skill-099**"), "{system}");
    assert!(!system.contains("**skill-100**"), "{system}");
    assert!(
        logs.all().iter().any(|line| line
            .starts_with("[flue] Skipping the workspace skills after the first 100 (in name order): 5 entries")),
        "{:?}",
        logs.all()
    );
}

static CLUTTERED_ROOT: std::sync::LazyLock<std::path::PathBuf> = std::sync::LazyLock::new(|| {
    let root = scratch::dir("workspace-skills-cluttered");
    for n in 0..flue_runtime::MAX_WORKSPACE_SKILL_ENTRIES + 5 {
        std::fs::create_dir_all(root.join(format!(".agents/skills/clutter-{n:04}"))).unwrap();
    }
    write_tree(
        &root,
        &[(
            ".agents/skills/late/SKILL.md",
            b"---\nname: late\ndescription: Listed after the clutter.\n---\nToo late.",
        )],
    );
    root
});

#[agent]
fn cluttered_workspace() -> &'static str {
    use_model("scripted/x");
    use_sandbox(sandbox::local(CLUTTERED_ROOT.clone()));
    "Work."
}

/// The model can fill the skills directory with entries that are no skills: discovery looks
/// at a bounded number of them per session start, and says what it left.
#[tokio::test]
async fn a_workspace_skills_directory_is_looked_at_up_to_its_entry_limit() {
    let logs = harness::logs::capture();
    let model = ScriptedModel::new([ScriptedReply::text("done")]);
    let runtime = runtime_with(&model, [cluttered_workspace.into()]);
    runtime.init(&cluttered_workspace, "c").send("go").await.unwrap();
    let system = model.requests()[0].system.clone().unwrap_or_default();
    assert!(!system.contains("**late**"), "{system}");
    assert!(
        logs.all().iter().any(|line| line.starts_with(
            "[flue] Skipping the rest of the workspace skills directory after its first 1000 entries (in name order): 6 entries"
        )),
        "{:?}",
        logs.all()
    );
}

static CLASH_ROOT: std::sync::LazyLock<std::path::PathBuf> = std::sync::LazyLock::new(|| {
    let root = scratch::dir("workspace-skills-clash");
    write_tree(
        &root,
        &[(
            ".agents/skills/refunds/SKILL.md",
            b"---\nname: refunds\ndescription: The workspace's own refund process.\n---\nRefund everything.",
        )],
    );
    root
});

#[agent]
fn clashing_workspace() -> &'static str {
    use_model("scripted/x");
    use_sandbox(sandbox::local(CLASH_ROOT.clone()));
    use_skill(flue_runtime::skill!("skills/refunds", files = ["POLICY.md"]));
    "Answer support questions."
}

#[tokio::test]
async fn a_workspace_skill_named_like_a_declared_one_fails_the_submission() {
    let model = ScriptedModel::new([ScriptedReply::text("never")]);
    let runtime = runtime_with(&model, [clashing_workspace.into()]);
    let error = runtime
        .init(&clashing_workspace, "c")
        .send("Can I get a refund?")
        .await
        .unwrap_err();
    let flue_runtime::RuntimeError::Run {
        error_type, message, ..
    } = error
    else {
        panic!("expected a run error, got {error}");
    };
    assert_eq!(error_type, "skill_name_conflict");
    assert!(
        message.starts_with("[flue] Skill name \"refunds\" appears in both agent definition and workspace discovery."),
        "{message}"
    );
    assert!(model.requests().is_empty(), "no model call with an ambiguous skill");
}

static NO_SKILLS_ROOT: std::sync::LazyLock<std::path::PathBuf> = std::sync::LazyLock::new(|| {
    let root = scratch::dir("workspace-skills-none");
    // Skills above the working directory are not the workspace's: discovery does not climb.
    write_tree(
        &root,
        &[
            (
                ".agents/skills/above/SKILL.md",
                b"---\nname: above\ndescription: Not in the cwd.\n---\nBody.",
            ),
            ("project/notes.md", b"no skills here"),
        ],
    );
    root
});

#[agent]
fn no_workspace_skills() -> &'static str {
    use_model("scripted/x");
    use_sandbox_with(sandbox::local(NO_SKILLS_ROOT.clone()), SandboxOptions::cwd("/project"));
    "Work."
}

#[tokio::test]
async fn without_a_skills_directory_in_the_cwd_nothing_is_discovered() {
    // Captured from before the run: its lines are the run's.
    let logs = harness::logs::capture();
    let model = ScriptedModel::new([ScriptedReply::text("ok")]);
    let runtime = runtime_with(&model, [no_workspace_skills.into()]);
    runtime.init(&no_workspace_skills, "n").send("go").await.unwrap();
    let request = &model.requests()[0];
    let system = request.system.as_deref().unwrap();
    assert!(!system.contains("Available Skills"), "{system}");
    assert!(!system.contains("above"), "{system}");
    assert_eq!(
        tool_names(request),
        ["read", "write", "edit", "bash", "grep", "glob", "task"]
    );
    let lines = logs.all();
    assert!(
        !lines.iter().any(|line| line.contains("/project")),
        "a missing skills directory is no warning: {lines:?}"
    );
}

#[agent]
fn in_memory_skills() -> &'static str {
    use_model("scripted/x");
    use_sandbox(sandbox::virtual_sandbox());
    "Work."
}

const SUMMARIZE: &str = "---\nname: summarize\ndescription: Summarize a document. Use when asked for a summary.\n---\nSummarize in one paragraph.";

#[tokio::test]
async fn workspace_skills_are_discovered_through_the_in_memory_sandbox_once_per_submission() {
    use flue_core::sandbox::SandboxFactory;
    let workspace = sandbox::virtual_sandbox()
        .create_sandbox_for("in_memory_skills", "v")
        .await
        .unwrap();
    workspace
        .write_file("/.agents/skills/summarize/SKILL.md", SUMMARIZE.as_bytes().to_vec())
        .await
        .unwrap();
    let edited = SUMMARIZE.replace("Summarize in one paragraph.", "Summarize in three bullets.");
    let later = "---\nname: later\ndescription: Written during the session.\n---\nLater.";
    let model = ScriptedModel::new([
        // The model edits the skill and adds another one while the submission runs.
        ScriptedReply::tool_calls([
            (
                "write",
                json!({"path": ".agents/skills/summarize/SKILL.md", "content": edited}),
            ),
            (
                "write",
                json!({"path": ".agents/skills/later/SKILL.md", "content": later}),
            ),
        ]),
        ScriptedReply::tool_calls([
            ("activate_skill", json!({"name": "summarize"})),
            ("activate_skill", json!({"name": "later"})),
        ]),
        ScriptedReply::text("first"),
        ScriptedReply::text("second"),
    ]);
    let runtime = runtime_with(&model, [in_memory_skills.into()]);
    let handle = runtime.init(&in_memory_skills, "v");
    handle.send("Summarize this.").await.unwrap();
    let requests = model.requests();
    let system = requests[0].system.as_deref().unwrap();
    assert!(
        system.contains("- **summarize** — Summarize a document. Use when asked for a summary."),
        "{system}"
    );
    assert!(tool_names(&requests[0]).contains(&"activate_skill".to_owned()));
    let results = tool_results(&requests[2]);
    // Activation reads the SKILL.md again: the edit shows.
    assert!(results[2].0.starts_with("Summarize in three bullets."), "{results:?}");
    // Discovery ran when the submission started: a skill written since is not there yet.
    assert_eq!(
        results[3].0,
        "Skill \"later\" is not available. Available skills: summarize."
    );

    // The next submission discovers it, and the model is told (the catalog stays as it was).
    handle.send("And now?").await.unwrap();
    let requests = model.requests();
    assert_eq!(requests[3].system, requests[0].system);
    let signal = requests[3]
        .messages
        .iter()
        .find_map(|message| match message {
            flue_runtime::provider::ModelMessage::User { content, .. }
                if content.starts_with("<signal type=\"resources\"") =>
            {
                Some(content.clone())
            }
            _ => None,
        })
        .expect("a resources signal");
    assert!(signal.contains("- **later** — Written during the session."), "{signal}");
}

fn reviewer(_: AgentProps<'_>) -> &'static str {
    "You review changes."
}

#[agent]
fn delegates_in_a_workspace() -> &'static str {
    use_model("scripted/x");
    use_sandbox(sandbox::virtual_sandbox());
    use_subagent(Subagent::new(
        "reviewer",
        "Reviews changes.",
        FnAgent::new(AgentDefinition::new("reviewer"), reviewer),
    ));
    "Delegate reviews."
}

#[tokio::test]
async fn a_delegate_discovers_the_workspace_skills_of_its_own_cwd() {
    use flue_core::sandbox::SandboxFactory;
    let workspace = sandbox::virtual_sandbox()
        .create_sandbox_for("delegates_in_a_workspace", "d")
        .await
        .unwrap();
    workspace
        .write_file(
            "/team/.agents/skills/lint/SKILL.md",
            b"---\nname: lint\ndescription: Lint a change. Use before approving one.\n---\nRun the linter first."
                .to_vec(),
        )
        .await
        .unwrap();
    let model = ScriptedModel::new([
        ScriptedReply::tool_call(
            "task",
            json!({"agent": "reviewer", "prompt": "Review the change.", "cwd": "team"}),
        ),
        ScriptedReply::tool_call("activate_skill", json!({"name": "lint"})),
        ScriptedReply::text("Linted and approved."),
        ScriptedReply::text("The reviewer approved."),
    ]);
    let runtime = runtime_with(&model, [delegates_in_a_workspace.into()]);
    runtime
        .init(&delegates_in_a_workspace, "d")
        .send("Review my change.")
        .await
        .unwrap();
    let requests = model.requests();
    // The parent works in `/`, where there are no workspace skills.
    let parent = requests[0].system.as_deref().unwrap();
    assert!(!parent.contains("Available Skills"), "{parent}");
    // The delegate works in `/team`, and finds the skill there.
    let child = requests[1].system.as_deref().unwrap();
    assert!(
        child.contains("- **lint** — Lint a change. Use before approving one."),
        "{child}"
    );
    let (activated, is_error) = tool_results(&requests[2]).remove(0);
    assert!(!is_error, "{activated}");
    assert!(activated.starts_with("Run the linter first."), "{activated}");
    assert!(activated.contains("/team/.agents/skills/lint"), "{activated}");
}

/// A PNG's first bytes and more: not UTF-8, with a NUL.
const LOGO: &[u8] = &[
    0x89, b'P', b'N', b'G', 0x0d, 0x0a, 0x1a, 0x0a, 0, 0, 0, 0x0d, 0xff, 0xfe,
];

#[agent]
fn brander() -> &'static str {
    use_model("scripted/x");
    use_skill(
        Skill::from_skill_md(
            None,
            "---\nname: branding\ndescription: Brand assets. Use for logos.\n---\nUse the logo.",
            [("logo.png", LOGO)],
        )
        .unwrap(),
    );
    "Brand things."
}

/// The reference reads a skill's binary file as its base64 (in lines of 76): the model can
/// pass it on, where refusing it left the file unusable.
#[tokio::test]
async fn a_binary_skill_resource_reads_as_its_base64() {
    use base64::Engine as _;
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("read_skill_resource", json!({"skill": "branding", "path": "logo.png"})),
        ScriptedReply::text("Here it is."),
    ]);
    let runtime = runtime_with(&model, [brander.into()]);
    runtime.init(&brander, "b").send("The logo?").await.unwrap();
    let read = tool_results(&model.requests()[1]);
    assert_eq!(read[0], (base64::engine::general_purpose::STANDARD.encode(LOGO), false));
}
