//! Skills: expertise the model loads only when it needs it.
//!
//! ```sh
//! cargo run --example skills
//! ```
//!
//! `skill!("skills/refunds", files = ["POLICY.md"])` embeds `examples/skills/refunds/SKILL.md`
//! and its policy file at compile time. The system prompt carries one catalog line; the model
//! activates the skill (the instructions arrive as a tool result) and reads the policy file
//! on demand. Offline, the scripted model does both.

mod common;

use std::sync::OnceLock;

use flue_runtime::prelude::*;
use flue_runtime::provider::ProviderRegistry;
use flue_runtime::store::MemoryStore;
use flue_runtime::testing::ScriptedReply;
use flue_runtime::{Runtime, RuntimeError};
use serde_json::json;

static MODEL: OnceLock<&'static str> = OnceLock::new();

#[agent]
fn support() -> &'static str {
    use_model(*MODEL.get().unwrap_or(&"scripted/example"));
    use_skill(flue_runtime::skill!("skills/refunds", files = ["POLICY.md"]));
    "You answer customer support questions."
}

#[tokio::main]
async fn main() -> Result<(), RuntimeError> {
    let mut providers = ProviderRegistry::with_defaults();
    let (model, notice) = common::choose_model(
        &mut providers,
        vec![
            ScriptedReply::tool_call("activate_skill", json!({"name": "refunds"})),
            ScriptedReply::tool_call("read_skill_resource", json!({"skill": "refunds", "path": "POLICY.md"})),
            ScriptedReply::text(
                "Opened software is not refundable, so I can't refund order B-22. The policy says: \"Opened software and gift cards are not refundable.\"",
            ),
        ],
    );
    let _ = MODEL.set(model);
    println!("{notice}");
    let runtime = Runtime::builder()
        .agent(support)
        .providers(providers)
        .store(MemoryStore::new())
        .build()?;
    let mut events = runtime.observe();
    let reply = runtime
        .init(&support, "customer-3")
        .send("I opened the software in order B-22 and want a refund.")
        .await?;
    common::observed(&mut events, |observation| {
        if let flue_runtime::events::Event::Tool {
            tool_name, is_error, ..
        } = observation.event
        {
            println!("tool: {tool_name} (error: {is_error})");
        }
    });
    println!("reply: {}", reply.text);
    Ok(())
}
