use flue_runtime::prelude::*;

#[agent]
fn assistant() -> &'static str {
    use_model("openai/gpt-4o");
    use_agent_finish(|ctx| async move {
        ctx.append(DeliveredMessage::user("keep going")).map_err(|error| error.to_string())
    });
    "Help."
}

fn main() {}
