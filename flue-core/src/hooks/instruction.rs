use std::borrow::Cow;

use super::hook;

/// Appends raw instruction text after the agent's returned instruction, in call order,
/// joined with blank lines. Any number of calls; works in subagent renders.
///
/// Panics when `text` is blank.
#[track_caller]
pub fn use_instruction(text: impl Into<Cow<'static, str>>) {
    let text = text.into();
    hook("use_instruction", |frame| {
        if text.trim().is_empty() {
            return Err("[flue] use_instruction() requires a non-empty string.".to_owned());
        }
        frame.rec.borrow_mut().instruction_parts.push(text);
        Ok(())
    });
}
