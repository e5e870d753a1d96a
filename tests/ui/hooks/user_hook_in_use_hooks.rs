use flue_runtime::prelude::*;

#[hook(user_client_attached)]
async fn greet(_user: &UserState, _client: &ClientInfo) {}

#[agent]
fn assistant() -> &'static str {
    use_model("openai/gpt-4o");
    use_hooks([greet]);
    "Help."
}

fn main() {}
