use super::{hook, root_only};
use crate::mcp::McpConnection;

/// Declares a remote MCP server whose tools the agent mounts as `mcp__<server>__<tool>`.
///
/// Read once per submission (a change takes effect on the next one). Panics on an invalid
/// definition, on a duplicate server name in one render, and in subagent renders.
#[track_caller]
pub fn use_mcp_connection(connection: McpConnection) {
    hook("use_mcp_connection", |frame| {
        root_only(
            frame,
            "[flue] use_mcp_connection() is not available in a subagent render. Declare the connection on the root agent and give the delegate what it needs through the parent's tools.",
        )?;
        connection.check("use_mcp_connection()")?;
        let mut rec = frame.rec.borrow_mut();
        if rec
            .mcp_connections
            .iter()
            .any(|declared| declared.name == connection.name)
        {
            return Err(format!(
                "[flue] use_mcp_connection() declared the MCP server name \"{}\" twice in one render. Each server declares once; share it from a single custom hook.",
                connection.name
            ));
        }
        rec.mcp_connections.push(connection);
        Ok(())
    });
}
