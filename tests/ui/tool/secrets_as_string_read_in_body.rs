use flue_runtime::prelude::*;

/// Close an issue.
#[tool(secrets = "GITHUB_TOKEN")]
async fn close_issue(ctx: &ToolContext, number: u64) -> Result<String, ToolError> {
    let _token = ctx.secret("GITHUB_TOKEN")?;
    Ok(format!("closed #{number}"))
}

fn main() {}
