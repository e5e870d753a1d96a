use super::hook;
use crate::tool::IntoTool;

/// Mounts a model-callable tool for this render: a `#[tool]` item, a [`crate::Tool`] built
/// with `Tool::new(..)`, or a clone of either.
///
/// Mounts may be conditional (set changes are narrated to the model). Duplicate names across
/// the render, and a name the framework reserves for its own tools, fail the render with
/// `ToolNameConflictError` after it returns. As the reference's `useTool()` does, the mount
/// checks the tool's definition: a name that is not a provider-safe name, a blank description, an argument
/// schema whose root is not an object, or a progress argument that is not a string property
/// panics with the definition message labelled `use_tool()` (a `#[tool]` item's schema exists
/// only at run time, and a hand-written handler's definition is checked nowhere else).
#[track_caller]
pub fn use_tool(tool: impl IntoTool) {
    let tool = tool.into_tool();
    hook("use_tool", |frame| {
        tool.definition().validate("use_tool()")?;
        frame.rec.borrow_mut().tools.push(tool);
        Ok(())
    });
}
