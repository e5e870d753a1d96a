use flue_runtime::prelude::*;

/// An error type that neither displays nor converts into a `HookError`.
struct NoRoom;

#[hook(before_create_message)]
async fn tag(_state: &ThreadState, _message: Message) -> Result<Message, NoRoom> {
    Err(NoRoom)
}

fn main() {}
