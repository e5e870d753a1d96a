use super::hook;
use crate::tool::IntoTool;

/// Mounts a model-callable tool for this render: a `#[tool]` item, a [`crate::Tool`] built
/// with `Tool::new(..)`, or a clone of either.
///
/// Mounts may be conditional (set changes are narrated to the model). Duplicate names across
/// the render fail the render with `ToolNameConflictError` after it returns.
#[track_caller]
pub fn use_tool(tool: impl IntoTool) {
    let tool = tool.into_tool();
    hook("use_tool", |frame| {
        frame.rec.borrow_mut().tools.push(tool);
        Ok(())
    });
}
