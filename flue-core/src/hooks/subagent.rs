use super::hook;
use crate::subagent::Subagent;

/// Declares a delegate for the framework's `task` tool.
///
/// The delegate's agent is rendered at delegation time, fresh per task, in a subagent frame.
/// Panics on an invalid definition (blank name or description, blank model override) and on a
/// duplicate name in one render. Works in subagent renders too (nested delegation).
#[track_caller]
pub fn use_subagent(subagent: Subagent) {
    hook("use_subagent", |frame| {
        subagent.check("use_subagent()")?;
        let mut rec = frame.rec.borrow_mut();
        if rec.subagents.iter().any(|declared| declared.name == subagent.name) {
            return Err(format!(
                "[flue] use_subagent() declared the subagent name \"{}\" twice in one render. Each delegate declares once; share it from a single custom hook.",
                subagent.name
            ));
        }
        rec.subagents.push(subagent);
        Ok(())
    });
}
