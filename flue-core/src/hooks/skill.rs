use super::hook;
use crate::skill::Skill;

/// Mounts a skill in the agent's catalog (one line in the system prompt; the full
/// instructions arrive through the `activate_skill` tool).
///
/// An agent with a sandbox also gets the skills its workspace provides without mounting them:
/// every `.agents/skills/<name>/SKILL.md` under the sandbox's working directory, found when
/// the session starts and listed after the mounted ones (flue-runtime's `sandbox` module
/// says more). A workspace skill named like a mounted one fails the submission
/// (`skill_name_conflict`) rather than one being chosen silently.
///
/// Panics when the same skill name is mounted twice in one render.
#[track_caller]
pub fn use_skill(skill: impl Into<Skill>) {
    let skill = skill.into();
    hook("use_skill", |frame| {
        let mut rec = frame.rec.borrow_mut();
        if rec.skills.iter().any(|mounted| mounted.name() == skill.name()) {
            return Err(format!(
                "[flue] use_skill() mounted the skill name \"{}\" twice in one render. Each skill mounts once; share it from a single custom hook.",
                skill.name()
            ));
        }
        rec.skills.push(skill);
        Ok(())
    });
}
