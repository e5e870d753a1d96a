use super::{hook, root_only};
use crate::lifecycle::ThreadHook;

/// Selects lifecycle hooks for this render (the Standard Agents "prompt hooks").
///
/// When the render's selection is non-empty it replaces the agent's `hooks`; when it is empty
/// the agent's `hooks` apply. Hooks of one kind run in listed order. Several calls (from
/// custom hooks) append. Panics when one hook is selected twice in one render.
///
/// Only thread hooks are accepted: a user-scope hook is a different type and does not compile.
/// Panics in subagent renders: a delegate's session runs no lifecycle hooks.
#[track_caller]
pub fn use_hooks(hooks: impl IntoIterator<Item = ThreadHook>) {
    // Consumed before the frame's recording is borrowed: a lazy selection may call other hooks.
    let hooks: Vec<ThreadHook> = hooks.into_iter().collect();
    hook("use_hooks", |frame| {
        root_only(
            frame,
            "[flue] use_hooks() is not available in a subagent render. Lifecycle hooks run against the root agent's conversation; a delegate's session runs none — shape what it sees in its tools, and check its result in the parent.",
        )?;
        let mut rec = frame.rec.borrow_mut();
        for selected in hooks {
            if let Some(existing) = rec.hooks.iter().find(|hook| hook.id() == selected.id()) {
                return Err(if *existing == selected {
                    format!(
                        "[flue] use_hooks() selected the lifecycle hook \"{}\" twice in one render. Select each hook once; hooks of one kind run in listed order.",
                        selected.id()
                    )
                } else {
                    crate::lifecycle::shared_id_message(selected.id(), existing.kind(), selected.kind())
                });
            }
            crate::lifecycle::check_hook_id(selected.id())?;
            rec.hooks.push(selected);
        }
        Ok(())
    });
}
