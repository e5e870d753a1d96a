use flue_runtime::prelude::*;

#[hook(before_create_message)]
async fn tag(_state: &ThreadState, message: Message) -> Result<Message, String> {
    Err(format!("no room for {:?}", message.id))
}

fn main() {}
