//! Reads of secrets the tokens cannot judge compile: a declared name, a name computed at run
//! time, and a body that binds the context's name again.
use flue_runtime::prelude::*;

/// Close an issue.
#[tool(secrets = ["GITHUB_TOKEN", "GITLAB_TOKEN"])]
async fn close_issue(ctx: &ToolContext, number: u64, forge: String) -> Result<String, ToolError> {
    let _declared = ctx.secret("GITHUB_TOKEN")?;
    let computed = format!("{}_TOKEN", forge.to_uppercase());
    let _computed = ctx.secret(&computed)?;
    Ok(format!("closed #{number}"))
}

struct Vault;

impl Vault {
    fn secret(&self, name: &str) -> String {
        name.to_owned()
    }
}

/// Look something up.
#[tool]
async fn look_up(ctx: &ToolContext, key: String) -> String {
    let _ = ctx.log();
    let ctx = Vault;
    ctx.secret(&key) + &ctx.secret("ANYTHING")
}

fn main() {
    let _ = (close_issue, look_up);
}
