use std::sync::Arc;

use super::{hook, root_only};
use crate::render::SandboxDeclaration;
use crate::sandbox::{SandboxFactory, SandboxOptions};

/// Attaches the environment this instance runs in.
///
/// At most once per render; may be conditional (presence is re-read at every turn boundary).
/// The factory and options are submission-scoped. Panics in a subagent render (delegates share
/// the parent's environment).
#[track_caller]
pub fn use_sandbox(factory: impl SandboxFactory) {
    use_sandbox_with(factory, SandboxOptions::default());
}

/// [`use_sandbox`] with options (a working directory).
#[track_caller]
pub fn use_sandbox_with(factory: impl SandboxFactory, options: SandboxOptions) {
    hook("use_sandbox", |frame| {
        root_only(
            frame,
            "[flue] use_sandbox() is not available in a subagent render. Delegates share the parent agent's environment (scope work with the task call's cwd instead).",
        )?;
        let mut rec = frame.rec.borrow_mut();
        if rec.sandbox.is_some() {
            return Err("[flue] use_sandbox() was called twice in one render. An agent has one environment — attach it once, in the agent body or a single custom hook.".to_owned());
        }
        if options.cwd.as_ref().is_some_and(String::is_empty) {
            return Err("[flue] use_sandbox() options.cwd must be a non-empty string.".to_owned());
        }
        rec.sandbox = Some(SandboxDeclaration {
            factory: Arc::new(factory),
            cwd: options.cwd,
        });
        Ok(())
    });
}
